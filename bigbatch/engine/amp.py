"""Mixed precision: autocast settings and an fp16 loss scaler with Fleet's counters.

`torch.amp.GradScaler` does the scaling, the fused unscale and the inf/nan
check. Its own `update()` backs off on *every* overflow; Fleet's
`update_loss_scaling` backs off only after `decr_every_n_nan_or_inf`
consecutive overflows and never below 1, and grows only when the grown scale
is finite. We keep those counters as tensors on the device, updated from the
step's overflow flag with tensor operations, and hand the new scale to
`GradScaler.update(new_scale=...)`: nothing here reads a value to the host
(the engine decides whether it reads the flag; see `Run.device_skip`).
"""

from __future__ import annotations

from typing import Any

import torch

from bigbatch.errors import ConfigError

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def amp_dtype(name: str) -> torch.dtype:
    """The autocast dtype for an `[amp] dtype` string."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"amp.dtype={name!r}: expected one of {', '.join(DTYPES)}") from None


class LossScaler:
    """Dynamic (or constant) fp16 loss scaling with Paddle/Fleet update rules.

    On an overflow step: the good counter resets, the bad counter grows, and
    when it reaches `decr_every_n_nan_or_inf` the scale is multiplied by
    `decr_ratio` (floored at 1). On a finite step: the bad counter resets, the
    good counter grows, and every `incr_every_n_steps` the scale is multiplied
    by `incr_ratio` if that stays finite. `dynamic=False` keeps the scale
    constant; overflow steps are still skipped.
    """

    def __init__(
        self,
        device_type: str,
        init_scale: float = 32768.0,
        incr_every_n_steps: int = 1000,
        decr_every_n_nan_or_inf: int = 2,
        incr_ratio: float = 2.0,
        decr_ratio: float = 0.5,
        dynamic: bool = True,
        sharded: bool = False,
    ) -> None:
        checks = (
            ("amp.init_loss_scaling", init_scale, init_scale > 0, "> 0"),
            ("amp.incr_every_n_steps", incr_every_n_steps, incr_every_n_steps >= 1, ">= 1"),
            ("amp.decr_every_n_nan_or_inf", decr_every_n_nan_or_inf, decr_every_n_nan_or_inf >= 1, ">= 1"),
            ("amp.incr_ratio", incr_ratio, incr_ratio > 1, "> 1"),
            ("amp.decr_ratio", decr_ratio, 0 < decr_ratio < 1, "in (0, 1)"),
        )
        for key, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"{key}={value}: expected {allowed}")
        self.incr_every_n_steps = int(incr_every_n_steps)
        self.decr_every_n_nan_or_inf = int(decr_every_n_nan_or_inf)
        self.incr_ratio = float(incr_ratio)
        self.decr_ratio = float(decr_ratio)
        self.dynamic = bool(dynamic)
        self.sharded = bool(sharded)
        """Gradients are sharded or sliced over ranks: an overflow seen by one rank skips
        the step on all (the flags are max-reduced over the world)."""
        self._device = torch.device(device_type)
        # The scale and Fleet's counters live on the device; `_good`/`_bad` are the
        # consecutive finite/overflow steps.
        self._scale = torch.full((), float(init_scale), dtype=torch.float32, device=self._device)
        self._good = torch.zeros((), dtype=torch.int64, device=self._device)
        self._bad = torch.zeros((), dtype=torch.int64, device=self._device)
        self.scaler = torch.amp.GradScaler(
            device_type,
            init_scale=float(init_scale),
            growth_factor=self.incr_ratio,
            backoff_factor=self.decr_ratio,
            growth_interval=self.incr_every_n_steps,
        )

    @property
    def scale_value(self) -> float:
        """The current loss scale (reads the device: for logging and statistics)."""
        return float(self._scale)

    @property
    def good_steps(self) -> int:
        return int(self._good)

    @property
    def bad_steps(self) -> int:
        return int(self._bad)

    @classmethod
    def from_config(cls, amp: Any, device_type: str, sharded: bool = False) -> LossScaler:
        """Build from an `[amp]` section (AmpConfig)."""
        return cls(
            device_type,
            init_scale=amp.init_loss_scaling,
            incr_every_n_steps=amp.incr_every_n_steps,
            decr_every_n_nan_or_inf=amp.decr_every_n_nan_or_inf,
            incr_ratio=amp.incr_ratio,
            decr_ratio=amp.decr_ratio,
            dynamic=amp.use_dynamic_loss_scaling,
            sharded=sharded,
        )

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale the optimizer's gradients in place; returns the overflow flag, a 0-d
        float32 tensor on the device (1 when any gradient is inf or nan, on any rank of a
        sharded run). Nothing is read to the host."""
        self.scaler.unscale_(optimizer)
        # GradScaler keeps the per-device flags only under a private name; torch is pinned.
        found = torch.zeros((), dtype=torch.float32, device=self._device)
        for f in self.scaler._found_inf_per_device(optimizer).values():
            found = torch.maximum(found, f.to(found.device, found.dtype))
        if self.sharded:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the counters after one optimizer step (taken or skipped), from the
        step's overflow flag, with tensor operations only (no host read)."""
        bad = found_inf > 0
        if self.dynamic:
            self._good = torch.where(bad, 0, self._good + 1)
            self._bad = torch.where(bad, self._bad + 1, 0)
            back_off = self._bad == self.decr_every_n_nan_or_inf
            self._scale = torch.where(back_off, (self._scale * self.decr_ratio).clamp_min(1.0),
                                      self._scale)
            self._bad = torch.where(back_off, 0, self._bad)
            grow = self._good == self.incr_every_n_steps
            grown = self._scale * self.incr_ratio
            self._scale = torch.where(grow & torch.isfinite(grown), grown, self._scale)
            self._good = torch.where(grow, 0, self._good)
        # Also clears GradScaler's per-iteration inf records.
        self.scaler.update(new_scale=self._scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "good_steps": self.good_steps,
                "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._good.fill_(int(state["good_steps"]))
        self._bad.fill_(int(state["bad_steps"]))
        sd = self.scaler.state_dict()
        sd.update(scale=float(state["scale"]), _growth_tracker=0)
        self.scaler.load_state_dict(sd)
