"""Atomic, verified checkpoints: save and resume everything stateful in a training run.

`save_checkpoint` writes `checkpoints/step-N.pt` (temporary file, fsync, rename),
then its manifest `step-N.json` (size and sha256 of the payload and of every DCP
file of a sharded step: `bigbatch.train.manifest`), the commit point, and keeps the
newest K. `latest_checkpoint` returns the newest checkpoint whose payload matches
its manifest and whose other files are all there at their sizes: a corrupt or
truncated one is skipped with a one-line warning and the previous good one is used
(the shards' digests are checked by the workers together: `bigbatch.train.verified`).
A payload without a manifest (a crash between the two renames, or files anyone could
have put there) was never committed: it is skipped like a damaged one, and when no
checkpoint is left the resume is refused in one line (`UntrustedFileError`, exit 2)
unless the user trusts it (`--trust-checkpoint`, ``trust=True``): then its zip structure
and CRCs are checked instead. Either way the payload is read as tensors and plain data
only (`bigbatch.engine.safe_load`): a pickled object is refused in one line, never
built. A save that fails midway (disk full: torch reports it as a RuntimeError) leaves
the previous checkpoints intact, removes its temporary file and raises
`CheckpointSaveError`. A payload torch cannot
read is a one-line `CheckpointError`; `load_training_checkpoint` also checks its
format (a foreign, older or newer payload is one too).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from bigbatch.engine.safe_load import check_plain, load_plain
from bigbatch.engine.saving import failure_reason
from bigbatch.errors import ConfigError, UntrustedFileError
from bigbatch.train.confined import resolves_inside
from bigbatch.train.manifest import (  # noqa: F401 - MANIFEST_FORMAT: re-exported
    MANIFEST_FORMAT,
    listed_problem,
    manifest_path,
    payload_problem,
    read_manifest,
    write_manifest,
)
from bigbatch.train.sharded import remove_sharded, sharded_dir, sharded_problem

__all__ = ["CHECKPOINT_DIR", "CHECKPOINT_FORMAT", "MANIFEST_FORMAT", "NO_MANIFEST", "QUIET_ENV",
           "TRUST_FLAG",
           "CheckpointDamagedError", "CheckpointError", "CheckpointSaveError", "WriteError",
           "atomic_save", "check_format", "checkpoint_path", "failure_reason",
           "latest_checkpoint", "list_checkpoints", "load_checkpoint", "newest_whole",
           "load_training_checkpoint", "manifest_path", "save_checkpoint",
           "save_failure", "verify_checkpoint", "warn_damaged",
           "write_text_atomic"]

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 2
"""Format of the payload `bigbatch.train.trainer` saves. 1: 0.1.0's, the weights in
"model"; 2 adds sharded runs, whose payload says "sharded" and whose weights and
optimizer state are DCP shards beside it (`bigbatch.train.sharded`)."""
_PAYLOAD_KEYS = ("step", "engine", "sampler", "rng")
# A parameter-server checkpoint keeps each worker's sampler and RNG inside this entry.
_PS_PAYLOAD_KEYS = ("step", "engine", "parameter_server")


class WriteError(OSError):
    """An output file could not be written (the message says which, and why)."""


class CheckpointSaveError(WriteError):
    """A checkpoint could not be written; the previous ones are intact."""


class CheckpointError(ConfigError):
    """A checkpoint that this version cannot resume from (foreign, older, newer, unreadable)."""


class CheckpointDamagedError(OSError):
    """No checkpoint of a run is whole any more (the message names each and why): a
    fault of the machine or its disks, not of the user's input."""

    everywhere = False
    """True when every rank raises it alike (then one of them says so)."""


def _size(n: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def save_failure(reason: str, directory: Path) -> str:
    """`reason` for a failed write in `directory`, with the space left there: torch's zip
    writer says only "file write failed" or "unexpected pos ..." (inline_container.cc)
    for a full disk, so a nearly full one is named as such."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return reason
    free = st.f_bavail * st.f_frsize
    torch_says = "write failed" in reason or "inline_container" in reason
    if free < (1 << 20) and "No space left" not in reason and torch_says:
        reason = os.strerror(errno.ENOSPC)
    return f"{reason}; {_size(free)} free in {directory}"


def atomic_save(obj, path: str | os.PathLike) -> None:
    """`torch.save` to a temporary file beside `path`, fsync, then rename over `path`.

    A reader (or a resume after a crash) sees either the old file or the new one,
    never a torn write.
    """
    _atomic_write(path, lambda f: torch.save(obj, f), "wb")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """`text` to `path` the same way: the old file or the new one, never a torn write."""
    _atomic_write(path, lambda f: f.write(text), "w")


def _atomic_write(path: str | os.PathLike, write: Any, mode: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except RuntimeError as e:  # torch.save's "file write failed": say why, while it is true
        if _disk_full(path.parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _disk_full(directory: Path) -> bool:
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


CHECKPOINT_DIR = "checkpoints"
_PREFIX, _SUFFIX = "step-", ".pt"


def checkpoint_path(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / CHECKPOINT_DIR / f"{_PREFIX}{step:09d}{_SUFFIX}"


def list_checkpoints(out: str | os.PathLike) -> list[Path]:
    """Checkpoint payloads in `out`, oldest first (temporary files are never listed;
    not verified: see `latest_checkpoint`)."""
    d = Path(out) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        stem = p.name.removeprefix(_PREFIX).removesuffix(_SUFFIX)
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX) and stem.isdigit():
            found.append((int(stem), p))
    return [p for _, p in sorted(found)]


NO_MANIFEST = "no manifest"
"""What `verify_checkpoint` says of a payload without one that the user did not trust."""


def verify_checkpoint(path: str | os.PathLike, trust: bool = False) -> str | None:
    """None when the checkpoint at `path` is whole as far as one process checks it (its
    payload, and its other files present at their sizes), else why not (a short phrase).
    A payload without a manifest is not whole unless `trust`: then its zip CRCs decide."""
    path = Path(path)
    try:
        meta = read_manifest(path)
        if meta is None and not trust:
            return NO_MANIFEST
        if meta is not None:
            problem = payload_problem(path, meta)
            if problem is None and meta.get("files"):
                return listed_problem(path, meta)
            if problem is None and sharded_dir(path).exists():  # a manifest of format 1
                return sharded_problem(path)
            return problem
        if sharded_dir(path).exists() and (problem := sharded_problem(path)):
            return problem
        with zipfile.ZipFile(path) as z:  # no manifest: torch.save's zip and its CRCs
            bad = z.testzip()
        return f"damaged entry {bad}" if bad else None
    except UntrustedFileError:  # DCP's index names a foreign object: said, never skipped
        raise
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        return f"unreadable ({type(e).__name__}: {e})".splitlines()[0]


QUIET_ENV = "BIGBATCH_CHECKPOINTS_CHECKED"
"""Set by `bigbatch train --nproc N` for its workers: it has said which checkpoints are
damaged, so they do not say it again."""
_warned: set[tuple[str, str]] = set()


def _says() -> bool:
    """Whether this process reports damaged checkpoints: one process of a job does."""
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    return os.environ.get("RANK", "0") == "0" and (
        os.environ.get(QUIET_ENV) != "1" or restarted)


def newest_whole(out: str | os.PathLike, before: Path | None = None, trust: bool = False
                 ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint (older than `before`) that verifies, or None, and the newer
    ones that do not, with why (newest first). `trust`: see `verify_checkpoint`."""
    found = list_checkpoints(out)
    if before is not None:
        found = [p for p in found if p.name < Path(before).name]
    bad = []
    for path in reversed(found):
        problem = verify_checkpoint(path, trust)
        if problem is None:
            return path, bad
        bad.append((path, problem))
    return None, bad


def warn_damaged(bad: list[tuple[Path, str]], using: Path) -> None:
    """One line for each damaged checkpoint a resume skips, naming the one it uses (once
    per process: the CLI asks more than once)."""
    for path, why in bad:
        if (str(path), why) not in _warned:
            _warned.add((str(path), why))
            if why == NO_MANIFEST:
                log.warning("warning: checkpoint %s has no manifest (its save did not finish, "
                            "or bigbatch did not write it); using %s", path.name, using.name)
            else:
                log.warning("warning: checkpoint %s is corrupt (%s); using %s", path.name, why,
                            using.name)


def latest_checkpoint(out: str | os.PathLike, before: Path | None = None,
                      warn: bool | None = None, trust: bool = False) -> Path | None:
    """The newest checkpoint (older than `before`) that verifies; a bad newer one is
    skipped with a one-line warning naming the one used (`warn`: by default, in one
    process of a job). None when none verifies: the caller says so, in one line.
    `trust`: a payload without a manifest may be used (`verify_checkpoint`)."""
    path, bad = newest_whole(out, before, trust)
    if path is not None and (warn if warn is not None else _says()):
        warn_damaged(bad, path)
    return path


def damaged_error(out: str | os.PathLike, bad: list[tuple[Path, str]]) -> CheckpointDamagedError:
    """The one line for a run none of whose checkpoints is whole."""
    shown = ", ".join(f"{p.name} ({why})" for p, why in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return CheckpointDamagedError(f"--resume: no good checkpoint in {Path(out) / CHECKPOINT_DIR}: "
                                  f"{shown}{more}")


TRUST_FLAG = "--trust-checkpoint"


def resume_checkpoint(out: str | os.PathLike, trust: bool = False) -> Path:
    """The checkpoint a resume of `out` starts from: ConfigError when it has none,
    `UntrustedFileError` when the only ones left have no manifest (and not `trust`),
    `CheckpointDamagedError` when none is whole."""
    path = latest_checkpoint(out, trust=trust)
    if path is not None:
        return path
    found = list_checkpoints(out)
    if not found:
        raise ConfigError(f"--resume: no checkpoint in {Path(out) / CHECKPOINT_DIR}")
    bad = [(p, verify_checkpoint(p, trust) or "?") for p in reversed(found)]
    unvouched = [p for p, why in bad if why == NO_MANIFEST]
    if unvouched and not trust:
        raise UntrustedFileError(
            f"--resume: checkpoint {unvouched[0].name} has no manifest "
            f"({manifest_path(unvouched[0]).name}), so nothing vouches that bigbatch wrote it; "
            f"refused. If you know where it came from, resume with {TRUST_FLAG} (it is still "
            "read as tensors and plain data only)")
    raise damaged_error(out, bad)


def save_checkpoint(out: str | os.PathLike, step: int, state: dict, keep: int = 2,
                    files: Any = None, shards: dict[str, dict] | None = None) -> Path:
    """Write `state` as the checkpoint of `step` atomically with its manifest; keep the
    newest `keep` ones. Raises `CheckpointSaveError` (older checkpoints intact) on failure.

    `files` (a `bigbatch.train.outdir.RunFiles`) records the files before they are
    written; with it only recorded files are pruned. `shards`: size and sha256 of the
    step's DCP files (`bigbatch.train.sharded.save_sharded`), for the manifest.
    """
    path = checkpoint_path(out, step)
    manifest = manifest_path(path)
    existed = path.exists()  # a step saved again: its old payload stays the fallback
    try:
        check_plain(state, f"checkpoint {path.name}")  # what a resume could not read back
    except ConfigError as e:
        raise CheckpointSaveError(f"saving checkpoint {path.name} failed ({e}); "
                                  f"{kept_line(out, path)}") from None
    try:
        if files is not None:
            files.make_dir(CHECKPOINT_DIR)
            files.add(path, manifest)
        # A step saved again keeps its old manifest until the new one replaces it: the old
        # payload still verifies if this save fails, a new one never verifies against it.
        atomic_save(state, path)
        write_manifest(path, step, shards, write_text_atomic)  # the commit point
    except (OSError, RuntimeError, pickle.PicklingError) as e:
        if not existed and not manifest.exists():  # never committed: no half-saved step
            path.unlink(missing_ok=True)
        raise CheckpointSaveError(
            f"saving checkpoint {path.name} failed "
            f"({save_failure(failure_reason(e), path.parent)}); {kept_line(out, path)}") from e
    prune(out, keep, files)
    return path


def kept_line(out: str | os.PathLike, failed: Path) -> str:
    """What a failed save of `failed` leaves to resume from."""
    previous = [p.name for p in list_checkpoints(out) if p != failed]
    return f"kept {previous[-1]}" if previous else "no earlier checkpoint"


def prune(out: str | os.PathLike, keep: int, files: Any = None) -> None:
    """Delete all but the newest `keep` checkpoints: their payloads, manifests and DCP
    files, only those bigbatch wrote (`files`, the run's record: with it, only recorded
    files), and a checkpoint's folder only once it is empty."""
    old = [p for p in (list_checkpoints(out)[:-keep] if keep > 0 else [])
           if resolves_inside(out, p)]  # never through a symlink out of --out
    if files is not None:
        old = [p for p in old if files.owns(p.relative_to(out).as_posix())]
    for p in old:
        remove_sharded(p, files)  # the DCP shards of a sharded step
        p.unlink(missing_ok=True)
        manifest_path(p).unlink(missing_ok=True)
    if files is not None and old:
        files.discard(*old, *map(manifest_path, old))


def load_checkpoint(path: str | os.PathLike, trust: bool = False) -> Any:
    """Load a checkpoint written by `save_checkpoint`, as tensors and plain data only
    (`bigbatch.engine.safe_load.load_plain`), from the very bytes that were checked
    against its manifest.

    Raises `UntrustedFileError` (one line) for a payload that holds any other object,
    that does not match its manifest, or that has none (unless `trust`); `CheckpointError`
    for a payload torch cannot read.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        meta = read_manifest(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: "
                              f"{type(e).__name__}: {failure_reason(e)}") from None
    if meta is None and not trust:
        raise UntrustedFileError(
            f"checkpoint {path.name} has no manifest ({manifest_path(path).name}), so nothing "
            f"vouches that bigbatch wrote it; refused (trust it with {TRUST_FLAG}, "
            "trust=True in the API)")
    if meta is not None:
        got = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if (got["bytes"], got["sha256"]) != (meta.get("bytes"), meta.get("sha256")):
            raise UntrustedFileError(f"checkpoint {path.name} does not match its manifest "
                                     f"({manifest_path(path).name}); refused")
    try:
        return load_plain(data, f"checkpoint {path.name}")
    except UntrustedFileError:
        raise
    except Exception as e:  # torch and zipfile: a damaged or foreign file
        raise CheckpointError(f"checkpoint {path} cannot be read: "
                              f"{type(e).__name__}: {failure_reason(e)}") from None


def load_training_checkpoint(path: str | os.PathLike, trust: bool = False) -> dict:
    """`load_checkpoint` of a training checkpoint: CheckpointError unless it is one, of a
    format this version reads."""
    ckpt = load_checkpoint(path, trust)
    check_format(ckpt, path)
    return ckpt


def check_format(ckpt: Any, path: str | os.PathLike) -> None:
    """CheckpointError unless `ckpt` is a training checkpoint of a format this version reads."""
    name = Path(path).name
    if not isinstance(ckpt, dict) or "engine" not in ckpt or not (
            "model" in ckpt or ckpt.get("sharded")):
        what = type(ckpt).__name__
        if isinstance(ckpt, dict):
            what += f" with keys {', '.join(map(str, list(ckpt)[:4])) or 'none'}"
        raise CheckpointError(f"checkpoint {name} is not a bigbatch training checkpoint (a {what})")
    fmt = ckpt.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise CheckpointError(f"checkpoint {name} has format {fmt!r}, from a bigbatch before "
                              f"0.1.0; this version reads format {CHECKPOINT_FORMAT}")
    if fmt > CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {name} has format {fmt}, from a newer bigbatch; "
                              f"this version reads format {CHECKPOINT_FORMAT}")
    keys = _PS_PAYLOAD_KEYS if "parameter_server" in ckpt else _PAYLOAD_KEYS
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {name} is incomplete: no {', '.join(missing)}")
