"""Errors a user can cause, as opposed to bugs.

The CLI prints these as one line and exits with status 2; library users can
catch them as `ValueError`.
"""


def on_every_rank(error: BaseException) -> BaseException:
    """Mark `error` as raised alike by every rank, after a collective that agreed on it
    (nothing else in flight): the run it leaves closes the process group it made on the
    way out (`Run.close`), so the job's processes exit cleanly, not with a live group."""
    error.on_every_rank = True  # type: ignore[attr-defined]
    return error


class ConfigError(ValueError):
    """A bad configuration key, value, file or combination of options."""


class PolicyError(ConfigError):
    """A policy that cannot be loaded, or one of its hooks raised (the message names it)."""


class PolicyStop(Exception):  # noqa: N818 - a requested end, not an error
    """A policy ended the run on purpose (after a checkpoint); `status` is the exit status
    the CLI returns (`bigbatch.adaptive.straggler.EXIT_STRAGGLER` for a straggler)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = int(status)


class PipelineError(RuntimeError):
    """A pipeline stage failed: every rank of the pipeline raises it, naming the stage and
    the layer where the error happened and the original error (`__cause__` on that rank)."""


class NonFiniteLossError(RuntimeError):
    """A non-finite loss that `nan_policy` may not skip (`stop`, or `skip` past its limit
    of consecutive steps); the message names the optimizer step. Raised on every worker
    alike; the CLI exits 1."""


class SaveStateError(OSError):
    """`run.save_state` failed on some rank (a full disk, a lost directory): every rank
    raises it, naming the rank and the reason; the previous state is kept and the partial
    one removed."""


class UntrustedFileError(ConfigError):
    """A file bigbatch was asked to read back is refused unread: it holds pickled objects
    other than tensors and plain data (loading it could run code), or it is a checkpoint
    with no manifest vouching for it (`--trust-checkpoint` / ``trust=True`` accepts that,
    never the objects). The message names the file and what was refused."""
