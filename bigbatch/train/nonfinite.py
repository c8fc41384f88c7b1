"""`nan_policy`: what a non-finite loss does to training (stop, or skip the step)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bigbatch.engine.nonfinite import NAN_POLICIES
from bigbatch.errors import NonFiniteLossError
from bigbatch.parallel.world import World

__all__ = ["NAN_POLICIES", "NonFiniteGuard", "NonFiniteLossError"]


class NonFiniteGuard:
    """`nan_policy` in fp32/bf16 (fp16 overflow is the loss scaler's): watches the losses.

    The flag is a device tensor summed per micro-step and read (all-reduced, so every
    worker decides alike) once per optimizer step, before the last backward.
    """

    def __init__(self, policy: str, world: World, device: torch.device, max_skips: int,
                 out: str):
        self.policy, self.world, self.max_skips, self.out = policy, world, max_skips, out
        self.flag = torch.zeros((), dtype=torch.float64, device=device)
        self.skipped = 0
        """Optimizer steps skipped for a non-finite loss (all of the run)."""
        self.consecutive = 0

    def should_skip(self, ms: Any, loss: torch.Tensor, step: int) -> bool:
        """Inside a micro-step's block, before `ms.backward`: True to `ms.skip()` the step."""
        self.flag += (~torch.isfinite(loss.detach())).any().double()
        if not ms.is_last:
            return False
        flag = self.flag
        if self.world.is_distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        bad = bool(flag.item() > 0)
        self.flag.zero_()
        if not bad:
            self.consecutive = 0
            return False
        keep = f"no checkpoint was written after it (in {self.out}/checkpoints)"
        if self.policy == "stop":
            raise NonFiniteLossError(
                f"non-finite loss at optimizer step {step} (nan_policy=stop); {keep}")
        self.consecutive += 1
        if self.consecutive >= self.max_skips:
            raise NonFiniteLossError(
                f"non-finite loss at {self.consecutive} consecutive optimizer steps, the last "
                f"at step {step} (nan_policy=skip); {keep}")
        self.skipped += 1
        return True
