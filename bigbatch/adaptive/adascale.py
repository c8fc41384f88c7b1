"""AdaScale (Johnson et al. 2020, "AdaScale SGD: A Scale-Invariant Algorithm for Distributed
Training", ICML).

A recipe tuned at a base batch ``B0`` (scale 1) runs at ``S = B / B0`` by multiplying the
learning rate with the *gain*::

    r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2),        1 <= r <= S

where ``mu^2 = |G|^2`` is the true gradient's squared norm and ``sigma^2`` the variance of
the *scale-1* gradient, i.e. ``tr(Sigma) / B0`` with ``Sigma`` the per-example covariance
(`bigbatch.adaptive.gns` estimates both). Pure noise (``mu = 0``) gives ``r = S``, the linear rule;
no noise (``sigma = 0``) gives ``r = 1``: a bigger batch buys nothing.

Each step advances a scale-invariant progress counter by ``r``: ``S``-scale training that
reaches progress ``T`` has made as much progress as ``T`` scale-1 steps. The scale-1
schedule (warmup and decay) is evaluated at the progress, not the step, and training ends
when progress reaches the scale-1 step count (`AdaScale.done`). Per optimizer step::

    position = adascale.progress                          # before this step's gain
    mult = adascale.update(tracker.sq_norm, tracker.trace)  # advances progress by r
    lr = schedule.lr(position) * mult                     # schedule built at scale 1

AdamScale (Adam/LAMB, used by Pollux/AdaptDL): the LR multiplier is ``r ** 0.5`` because
Adam's update already scales with the gradient's inverse root-variance; pass ``power=0.5``
and feed statistics of the preconditioned gradient (`bigbatch.adaptive.gns.adam_sq_norm`).
Progress still advances by ``r``.

Note ``r / S = (B_noise + B0) / (B_noise + B)`` with ``B_noise = tr(Sigma) / |G|^2``:
Pollux's statistical efficiency (`bigbatch.adaptive.goodput.efficiency`).
"""

import math
from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["AdaScale", "gain"]


def gain(var: float, sqr: float, scale: float) -> float:
    """AdaScale gain ``(var + sqr) / (var / scale + sqr)``, clipped to ``[1, scale]``.

    ``var``: variance of the scale-1 gradient (``tr(Sigma) / B0``); ``sqr``: ``|G|^2``;
    ``scale``: ``B / B0``. Negative estimates count as 0; with neither signal nor noise
    (or a NaN input) the gain is 1. For ``scale < 1`` the range is ``[scale, 1]``.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"adascale scale={scale} is out of range; allowed: finite and > 0")
    if math.isnan(var) or math.isnan(sqr):
        return 1.0
    var, sqr = max(var, 0.0), max(sqr, 0.0)
    if math.isinf(var) or math.isinf(sqr):
        r = scale if math.isinf(var) and not math.isinf(sqr) else 1.0
    elif var == 0.0 and sqr == 0.0:
        r = 1.0
    else:
        r = (var + sqr) / (var / scale + sqr)
    lo, hi = min(1.0, scale), max(1.0, scale)
    return min(max(r, lo), hi)


class AdaScale:
    """AdaScale's gain and scale-invariant progress, fed noise statistics once per step.

    ``base_batch_size``: the batch the recipe (base LR, schedule, step count) is tuned at;
    ``global_batch_size``: the batch actually trained with (micro * k_steps * world size;
    change it with `set_batch_size` when the batch size adapts); ``power``: exponent
    applied to the gain for the LR (1: AdaScale for SGD, 0.5: AdamScale).
    """

    def __init__(self, base_batch_size: int, global_batch_size: int, *, power: float = 1.0):
        if base_batch_size < 1:
            raise ConfigError(
                f"batch.base_batch_size={base_batch_size} is out of range; allowed: >= 1"
            )
        if not 0.0 < power <= 1.0:
            raise ConfigError(f"adascale power={power} is out of range; allowed: 0 < power <= 1")
        self.base_batch_size = int(base_batch_size)
        """Scale-1 batch size ``B0``."""
        self.power = float(power)
        """LR multiplier is ``gain ** power``."""
        self.global_batch_size = 0
        """Current global batch ``B`` (set through `set_batch_size`)."""
        self.set_batch_size(global_batch_size)
        self.progress = 0.0
        """Scale-invariant progress: sum of the gains so far, in scale-1 steps."""
        self.steps = 0
        """Optimizer steps taken (updates)."""
        self.last_gain = 1.0
        """Gain ``r`` of the latest update (1 before any)."""

    @property
    def scale(self) -> float:
        """``S = global_batch_size / base_batch_size``."""
        return self.global_batch_size / self.base_batch_size

    def set_batch_size(self, global_batch_size: int) -> None:
        """Use a new global batch from the next update on (progress is unaffected)."""
        if global_batch_size < 1:
            raise ConfigError(
                f"global_batch_size={global_batch_size} is out of range; allowed: >= 1"
            )
        self.global_batch_size = int(global_batch_size)

    def gain(self, sq_norm: float, trace: float) -> float:
        """Gain at the current scale from ``|G|^2`` and per-example ``tr(Sigma)``."""
        return gain(trace / self.base_batch_size, sq_norm, self.scale)

    def update(self, sq_norm: float, trace: float) -> float:
        """One optimizer step: compute the gain, advance progress by it, return LR multiplier.

        ``sq_norm`` / ``trace``: the tracker's ``GradientNoiseScale.sq_norm`` / ``.trace``
        including this step's measurement; NaN (no estimate yet) gives gain 1.
        """
        r = self.gain(float(sq_norm), float(trace))
        self.last_gain = r
        self.progress += r
        self.steps += 1
        return r**self.power

    @property
    def lr_factor(self) -> float:
        """LR multiplier of the latest update: ``last_gain ** power``."""
        return self.last_gain**self.power

    def done(self, total_scale1_steps: float) -> bool:
        """Whether the run has made the progress of ``total_scale1_steps`` scale-1 steps."""
        return self.progress >= total_scale1_steps

    def state_dict(self) -> dict[str, Any]:
        return {
            "base_batch_size": self.base_batch_size,
            "global_batch_size": self.global_batch_size,
            "power": self.power,
            "progress": self.progress,
            "steps": self.steps,
            "last_gain": self.last_gain,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_batch_size = int(state["base_batch_size"])
        self.set_batch_size(int(state["global_batch_size"]))
        self.power = float(state["power"])
        self.progress = float(state["progress"])
        self.steps = int(state["steps"])
        self.last_gain = float(state["last_gain"])

    def __repr__(self) -> str:
        return (
            f"AdaScale(scale={self.scale:g}, gain={self.last_gain:.4g}, "
            f"progress={self.progress:.1f}, steps={self.steps}, power={self.power:g})"
        )
