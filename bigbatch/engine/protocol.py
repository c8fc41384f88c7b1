"""What the engine's parts may use of a `Run`, as a Protocol.

`Run` (in `bigbatch.engine.run`) is built from the parts beside this file: the
micro-step, the gradient statistics, the saved state and the `[adaptive]`
controller. They receive the run and annotate it with `RunLike`, so none of them
imports `Run`, which imports them. `Run` satisfies it structurally; an attribute
a part starts to use belongs here first.

The underscored attributes are the merge window's bookkeeping, shared by the
run and its micro-step only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["RunLike"]


class RunLike(Protocol):
    # What a user configures and reads.
    module: nn.Module
    optimizer: torch.optim.Optimizer
    world: Any
    mesh: Any
    pipeline: Any
    pipeline_norms: Any
    plan: Any
    strategy: Any
    scaler: Any
    autocast_dtype: torch.dtype | None
    avg: bool
    k_steps: int
    step: int
    micro: int
    skipped_steps: int
    progress: float
    progress_rate: float
    unit_batch_size: int
    lr_scale: float
    last_lr: float
    grad_hooks: list[Callable[[Any], None]]
    step_hooks: list[Callable[[Any], None]]
    state_objects: dict[str, Any]
    adaptive: Any
    local_sgd: Any
    batch_size_changes: list[dict[str, Any]]
    last_step_seconds: float
    sync_timing: bool
    track_grad_norm: bool
    policies: Any
    micro_batch_sizes: list[int] | None
    timing: Any

    def micro_step(self) -> Any: ...
    def lr_at(self, progress: float) -> float: ...
    def set_batch(self, micro_batch_size: int, k_steps: int) -> None: ...
    def stats(self) -> dict[str, float]: ...
    def skip_step(self) -> None: ...
    def synchronize(self) -> None: ...

    # The merge window and the step's internals.
    _ddp: nn.Module | None
    _fsdp: nn.Module | None
    _loss_parallel: bool
    _comm: Any
    _params: list[torch.Tensor]
    _measure_first: bool
    _first_sq_norm: Callable[[list[torch.Tensor]], torch.Tensor]
    _grad_norm: torch.Tensor | None
    _mode: str | None
    _count: float
    _count_tensor: torch.Tensor | None
    _count_work: Any
    _first_sq: torch.Tensor | None
    _first_count: float

    @property
    def _mean_mult(self) -> float: ...
    @property
    def _count_mult(self) -> float: ...
    def _reset_window(self) -> None: ...
    def _finish_step(self, t0: float) -> bool: ...
    def _add_step_time(self, t0: float) -> None: ...
    def _set_lr(self, lr: float) -> None: ...
