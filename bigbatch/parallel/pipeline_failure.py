"""One stage's exception ends the whole pipeline within seconds, named on every rank.

torch's pipeline schedules block in point-to-point receives. When one stage raises
(a mistake in a user's layer), the others would see a bare "Connection closed by
peer", or, if the failing rank's code caught the error and went on to a collective,
wait for the process group's timeout. `raise_together` makes every rank raise a
`PipelineError` that names the stage, the layer and the original error:

- the rank whose layer raised writes one line into the job's rendezvous store and
  tears its process groups down, so that a collective it meets later fails at once
  instead of waiting (its peers' receives break when its connections close);
- a rank whose receive broke reads that line (waiting up to 10 s for it) and raises
  it as its own; without a line (the failing rank, or the store's host, is gone) it
  says that another stage stopped.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bigbatch.errors import PipelineError
from bigbatch.parallel.pipeline import LAYER_ATTR
from bigbatch.parallel.world import is_peer_failure

__all__ = ["raise_together"]

_KEY = "bigbatch/pipeline_failure"
_WAIT_S = 10.0  # for the failing rank's line to appear


def _store() -> Any:
    # The rendezvous store every rank shares (torch keeps it under a private name).
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def raise_together(exc: BaseException, stage: int, stages: int, peers: int) -> None:
    """Raise `PipelineError` for `exc`, raised on this rank (stage `stage` of `stages`)
    during a pipeline step, coordinated with the `peers` other ranks of the pipeline."""
    if not dist.is_initialized():
        raise exc
    store = _store()
    if is_peer_failure(exc):  # another stage failed: its line says where and why
        try:
            store.wait([_KEY], timedelta(seconds=_WAIT_S))
            line = store.get(_KEY).decode()
        except Exception:  # noqa: BLE001 - no line: the failing rank (or the store) is gone
            line = (f"another pipeline stage stopped ({str(exc).splitlines()[0][:160]}); "
                    "its own output names the error")
        _abort()
        raise PipelineError(f"{line}; stage {stage} stopped with it") from None
    where = getattr(exc, LAYER_ATTR, None)
    line = (f"pipeline stage {stage} of {stages}" + (f", layer {where!r}" if where else "")
            + f": {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    with contextlib.suppress(Exception):  # a store gone with a peer: raise what we know
        store.set(_KEY, line)
    _abort()
    raise PipelineError(line) from exc


def _abort() -> None:
    """Break every group's connections (a peer blocked in a receive wakes at once), then
    forget the groups, so a later collective fails at once instead of waiting."""
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _abort_process_group

    with contextlib.suppress(Exception):  # a backend without abort: destroying is enough
        _abort_process_group()  # ProcessGroupGloo.abort / NCCL's abort, on every group
    if dist.is_initialized():  # abort may have forgotten the groups already
        dist.destroy_process_group()
