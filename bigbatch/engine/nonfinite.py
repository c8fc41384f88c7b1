"""`nan_policy` in a run: what a non-finite loss does to its optimizer step.

`stop` (the default, as `bigbatch train --nan-policy`) raises `NonFiniteLossError`
naming the optimizer step; `skip` drops that step's gradients, counts it
(`run.nonfinite_skipped_steps`) and raises after `MAX_NONFINITE_SKIPS` consecutive
ones. Either way no weight sees the bad gradient. fp16 runs leave it to the loss
scaler, whose overflow skip covers a non-finite loss.

Every loss `ms.backward` gets adds its finiteness to a flag on the device; how the flag
is read is the run's choice:

- read at the last micro-step, before its backward (all-reduced, so every worker
  decides alike): one host read per optimizer step, free on CPU. The step is then
  skipped as `ms.skip()` skips it: no backward, the schedule stays.
- on the device (`Run.nan_check_on_device`: CUDA, an optimizer that honours
  `found_inf`, no gradient hooks, no stateful comm hook, no local SGD): the flag goes to the optimizer as fp16's overflow flag
  does, so the update is skipped there and nothing waits. Its value is copied to
  pinned memory behind the step and looked at when the copy has landed, a step or a
  few later; `check()` waits for it (`run.stats`, `run.state_dict()`, `save_state`
  call it), so `stop` raises before anything is saved. The schedule advances over a
  step skipped this way, as over an fp16 overflow (`run.skipped_steps` counts it).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.errors import ConfigError, NonFiniteLossError

__all__ = ["MAX_NONFINITE_SKIPS", "NAN_POLICIES", "LossGuard"]

NAN_POLICIES = ("stop", "skip")
MAX_NONFINITE_SKIPS = 10
"""`skip` gives up (raises) after this many consecutive skipped optimizer steps."""


def check_policy(policy: str) -> str:
    if policy not in NAN_POLICIES:
        raise ConfigError(f"nan_policy={policy!r} is not valid; allowed: "
                          f"{', '.join(NAN_POLICIES)}")
    return policy


class _Landing:
    """One optimizer step's flag on its way to the host: a pinned copy and the event
    after it (CUDA), or the value itself (other devices, where a read is free)."""

    __slots__ = ("step", "value", "event")

    def __init__(self, step: int, flag: torch.Tensor) -> None:
        self.step = step
        self.event = None
        if flag.device.type == "cuda":
            self.value = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self.value.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.value = flag.clone()

    def landed(self) -> bool:
        return self.event is None or self.event.query()

    def bad(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.value > 0)


class LossGuard:
    """A run's `nan_policy`: watches the losses and decides on each optimizer step.

    `observe(loss)` per micro-step; then either `decide(step)` (host read, before the
    last backward: True to skip) or `take(step)` (on the device: the flag for the
    optimizer, looked at later by `poll`/`check`). `reset()` when the window is
    dropped. State: the skipped steps of the run and the current consecutive run.
    """

    def __init__(self, policy: str, device: torch.device, *, distributed: bool,
                 max_skips: int = MAX_NONFINITE_SKIPS) -> None:
        self.policy = check_policy(policy)
        self.distributed = bool(distributed)
        self.max_skips = int(max_skips)
        self.skipped = 0
        """Optimizer steps skipped for a non-finite loss (all of the run)."""
        self.consecutive = 0
        self._flag = torch.zeros((), dtype=torch.float32, device=device)
        self._landing: deque[_Landing] = deque()

    def observe(self, loss: torch.Tensor) -> None:
        """One micro-step's loss (before any scaling); nothing is read. A DTensor loss
        (tensor parallelism) is looked at through its local part: a partial sum is
        non-finite wherever the whole is, and the flag is all-reduced before it is read."""
        loss = loss.detach()
        if hasattr(loss, "to_local"):
            loss = loss.to_local()
        self._flag += (~torch.isfinite(loss)).any()

    def reset(self) -> None:
        """The merge window was dropped (`run.skip_step`): its losses no longer count."""
        self._flag.zero_()

    def _reduced(self) -> torch.Tensor:
        flag, self._flag = self._flag, torch.zeros_like(self._flag)
        if self.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return flag

    def decide(self, step: int) -> bool:
        """Read the window's flag (every worker alike): raise under `stop` or past the
        skip limit, else True when optimizer step `step` (1-based) is to be skipped."""
        return self._count(step, bool(self._reduced() > 0))

    def take(self, step: int) -> torch.Tensor:
        """On the device: the window's flag (all-reduced) for the optimizer's `found_inf`;
        first looks at the earlier steps' flags that have landed."""
        self.poll()
        flag = self._reduced()
        self._landing.append(_Landing(step, flag))
        return flag

    def poll(self) -> None:
        """Count the landed flags in step order (raising as `decide` does); never waits."""
        while self._landing and self._landing[0].landed():
            done = self._landing.popleft()
            self._count(done.step, done.bad())

    def check(self) -> None:
        """Wait for every flag still on its way and count it (raising as `decide` does)."""
        while self._landing:
            done = self._landing.popleft()
            self._count(done.step, done.bad())

    def _count(self, step: int, bad: bool) -> bool:
        if not bad:
            self.consecutive = 0
            return False
        if self.policy == "stop":
            self._landing.clear()
            raise NonFiniteLossError(f"non-finite loss at optimizer step {step} "
                                     "(nan_policy=stop); its update was not applied")
        self.consecutive += 1
        if self.consecutive >= self.max_skips:
            self._landing.clear()
            raise NonFiniteLossError(
                f"non-finite loss at {self.consecutive} consecutive optimizer steps, the last "
                f"at step {step} (nan_policy=skip)")
        self.skipped += 1
        return True

    def stats(self) -> dict[str, float]:
        self.check()
        return {"nonfinite_skipped_steps": float(self.skipped)}

    def state_dict(self) -> dict[str, Any]:
        self.check()
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.consecutive = int(state.get("consecutive", 0))
