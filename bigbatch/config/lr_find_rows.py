"""The compatibility table's rows for `[batch] lr_find` (`bigbatch.config.compat` splices
them into `CONFLICTS`): where the range test before training cannot run, or would be
overruled."""

from __future__ import annotations

from typing import Any

from bigbatch.config.conflict import Conflict

__all__ = ["LR_FIND_ROWS"]

_FIX = "find the LR with `bigbatch lr-find` and set batch.base_lr, or set batch.lr_find = false"


def _split(s: Any) -> str | None:
    """The first of [sharding], tensor or pipeline parallelism in use."""
    return ("[sharding]" if s.sharding.enable
            else "tensor parallelism" if s.tensor_parallel.tensor_parallel_degree > 1
            else "[pipeline]" if s.pipeline.enable else None)


C = Conflict
LR_FIND_ROWS: tuple[Conflict, ...] = (
    C("lr-find-parameter-server", "batch.lr_find", "[parameter_server]",
      lambda s, c: s.batch.lr_find and s.parameter_server.enable,
      "{a} with {b} is not supported: {reason}; {fix}",
      "the range test runs in the data-parallel trainer, and the parameter-server job has "
      "servers and workers instead", _FIX,
      {"batch": {"lr_find": True}, "parameter_server": {}}),
    C("lr-find-adascale", "batch.lr_find", 'adaptive.lr = "adascale"',
      lambda s, c: s.batch.lr_find and s.adaptive.lr == "adascale",
      '{a} with {b}: {reason}; {fix}',
      "AdaScale sets every step's LR from the noise scale, so a found peak would be "
      "overruled", "switch one of them off",
      {"batch": {"lr_find": True, "scaling": "none"}, "adaptive": {"lr": "adascale"}}),
    C("lr-find-mesh", "batch.lr_find", "[sharding], tensor parallelism or [pipeline]",
      lambda s, c: s.batch.lr_find and _split(s) is not None,
      "{a} with {what} is not supported: {reason}; {fix}",
      "the range test trains a second, whole copy of the model with plain data parallelism",
      _FIX, {"batch": {"lr_find": True}, "sharding": {}},
      values=lambda s, c: {"what": _split(s)}),
)
del C
