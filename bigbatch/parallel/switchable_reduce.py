"""`SwitchableReduce`: all-reduce or local SGD, switched between optimizer steps while the
job runs (KungFu's adaptive synchronisation, Mai et al., OSDI 2020).

Two modes:

- ``allreduce``: DDP's mean of the workers' gradients every step (torch's
  ``allreduce_hook`` inside the engine's comm hook);
- ``local``: each worker steps on its own gradient and the workers average their
  weights every `k_steps` local steps (model averaging, as `[localsgd]` does with
  torch's ``average_parameters``).

Why a switch at a step boundary is exact in place:

- all-reduce -> local: after an all-reduced step every worker holds the same weights
  and optimizer state, so local steps start from one model; nothing moves.
- local -> all-reduce: the workers' weights and optimizer state are averaged first
  (`synchronize`), so the next all-reduced step starts from one model again.

Checkpoints call `synchronize` (through `Run.synchronize`), so in local mode a
checkpoint holds the average, in the uninterrupted run too, and a resume equals it.

The averaging is timed after a barrier (so a late worker's lateness is not counted
as communication): `take_average_time` gives the seconds per average to the policy
that decides (`bigbatch.engine.sync_switch`).

Test-only: ``BIGBATCH_TEST_SLOW_REDUCE="SECONDS@FIRST-LAST"`` sleeps SECONDS inside
every all-reduce of steps FIRST..LAST (1-based) and inside every averaging after
those steps, to make communication dominate a step in a test. Never set it in a job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.model_averaging import utils as averaging

__all__ = ["MODES", "SLOW_REDUCE_ENV", "SwitchableReduce"]

MODES = ("allreduce", "local")
SLOW_REDUCE_ENV = "BIGBATCH_TEST_SLOW_REDUCE"


def _slow_reduce_from_env() -> tuple[float, int, int] | None:
    text = os.environ.get(SLOW_REDUCE_ENV, "").strip()
    if not text:
        return None
    try:
        seconds, _, steps = text.partition("@")
        first, _, last = steps.partition("-")
        return float(seconds), int(first), int(last)
    except ValueError:
        raise ValueError(f"{SLOW_REDUCE_ENV}={text!r}: expected SECONDS@FIRST-LAST, "
                         "e.g. 0.3@3-8") from None


class _HookState:
    """The comm hook's state: which switch it asks (kept apart so that DDP's comm state
    does not save the switch a second time)."""

    __slots__ = ("switch",)

    def __init__(self, switch: SwitchableReduce) -> None:
        self.switch = switch


def _switch_hook(state: _HookState, bucket: Any) -> torch.futures.Future:
    sw = state.switch
    if sw.mode == "local":
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())  # this worker's own gradient
        return fut
    sw.test_delay(sw.step + 1)
    return allreduce_hook(sw.group, bucket)


class SwitchableReduce:
    """A run's reduction that a policy may switch (`to_local`, `to_allreduce`)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 k_steps: int, group: Any = None) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.k_steps = int(k_steps)
        """Local steps between model averages (H)."""
        self.group = group
        self.mode = "allreduce"
        self.step = 0
        """The latest optimizer step taken (1-based)."""
        self.local_steps = 0
        """Local steps since the switch to local SGD."""
        self.switches = 0
        self.averages = 0
        self._avg_seconds = 0.0
        self._avg_count = 0
        self._slow = _slow_reduce_from_env()

    @property
    def hook(self) -> tuple[Any, _HookState]:
        """(hook, state) for `wrap_data_parallel(..., inner=...)`."""
        return _switch_hook, _HookState(self)

    def _group(self) -> Any:
        return self.group if self.group is not None else dist.group.WORLD

    def test_delay(self, step: int) -> None:
        if self._slow is not None and self._slow[1] <= step <= self._slow[2]:
            time.sleep(self._slow[0])

    # ------------------------------------------------------------- the engine's side

    def observe(self, loss: torch.Tensor, count: Any = None) -> None:
        """The micro-step's loss (`run.local_sgd`'s interface); not needed here."""

    def after_step(self, step: int, lr: float = 0.0) -> None:
        """After optimizer step `step` (at `lr`, unused): in local mode, average every
        `k_steps` local steps."""
        self.step = int(step)
        if self.mode != "local":
            return
        self.local_steps += 1
        if self.local_steps % self.k_steps == 0:
            dist.barrier(group=self._group())  # a late worker's lateness is not transfer time
            t0 = time.perf_counter()
            self.test_delay(self.step)
            averaging.average_parameters(iter(self.params), self._group())
            self._avg_seconds += time.perf_counter() - t0
            self._avg_count += 1
            self.averages += 1

    def take_average_time(self) -> tuple[float, int]:
        """(seconds spent averaging, averages) since the last call."""
        out = (self._avg_seconds, self._avg_count)
        self._avg_seconds, self._avg_count = 0.0, 0
        return out

    def synchronize(self) -> None:
        """Local mode: average the workers' weights and optimizer state now (checkpoints,
        evaluation, the switch back); all-reduce mode: nothing differs, nothing to do."""
        if self.mode != "local":
            return
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
        averaging.average_parameters(iter([*self.params, *state]), self._group())

    # ------------------------------------------------------------- the policy's side

    def to_local(self) -> None:
        """Switch to local SGD (every worker, between steps)."""
        if self.mode == "local":
            return
        self.mode, self.local_steps = "local", 0
        self.switches += 1

    def to_allreduce(self) -> None:
        """Average the models and switch back to all-reduce (every worker, between steps)."""
        if self.mode == "allreduce":
            return
        self.synchronize()
        self.mode = "allreduce"
        self.switches += 1

    # ------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "step": self.step, "local_steps": self.local_steps,
                "switches": self.switches, "averages": self.averages}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mode = str(state["mode"])
        if mode not in MODES:
            raise ValueError(f"sync switch state: mode {mode!r} is not one of {MODES}")
        self.mode = mode
        self.step = int(state["step"])
        self.local_steps = int(state["local_steps"])
        self.switches = int(state["switches"])
        self.averages = int(state["averages"])

    def stats(self) -> dict[str, float]:
        return {"sync_local": float(self.mode == "local"), "sync_switches": float(self.switches),
                "sync_averages": float(self.averages)}
