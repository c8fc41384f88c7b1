"""When a growing global batch (``batch.schedule``) doubles: two decision rules.

Both only ever double the batch, never shrink it, and stop at a ceiling (the
configured ``batch.global_batch_size``). Both are stateless: where a run stands
follows from the batch in force, so a resume needs nothing but the batch.

- `NoiseScaleGrowth` (``"adaptive"``): the gradient noise scale
  ``B_noise = tr(Sigma) / |G|^2`` grows as the loss falls (McCandlish et al. 2018,
  "An Empirical Model of Large-Batch Training"). Training at a batch ``B`` costs
  ``S = S_min (1 + B_noise / B)`` steps and ``E = E_min (1 + B / B_noise)`` samples to a
  given loss, so a batch held at a fixed fraction ``f`` of the noise scale spends at most
  ``1 + f`` times the fewest samples while its steps fall as the noise scale grows. The
  rule doubles ``B`` while ``2 B <= f * B_noise`` (several times at one decision when
  the noise scale has outgrown the batch by more). Unlike KungFu's doubling policy
  (`bigbatch.adaptive.doubling`), which follows the noise scale's growth from wherever
  the batch started, the target is absolute: a start batch already past ``f * B_noise``
  waits for the noise scale to catch up.
- `SeesawGrowth` (``"seesaw"``; Meterez et al. 2025, "Seesaw: accelerating training by
  balancing learning rate and batch size scheduling"): wherever the LR decay would halve
  the LR, double the batch instead. With the peak LR following ``batch.scaling`` on each
  doubling, the LR then falls by ``2**(1 - p)`` per halving for a rule ``B**p``: by
  ``sqrt(2)`` under square-root scaling (Seesaw's rule for Adam) and not at all under
  linear scaling (Smith et al. 2018, "Don't decay the learning rate, increase the batch
  size", for SGD).
"""

from __future__ import annotations

import math

__all__ = ["NoiseScaleGrowth", "SeesawGrowth", "doublings"]


def doublings(batch: int, start: int) -> int:
    """How many times a batch that started at `start` has doubled to reach `batch`."""
    return max(0, round(math.log2(batch / start)))


class NoiseScaleGrowth:
    """`decide(noise_scale, batch, ceiling)` -> `batch` doubled once or more, or None."""

    def __init__(self, fraction: float) -> None:
        if not fraction > 0:
            raise ValueError(f"fraction={fraction}: must be > 0")
        self.fraction = float(fraction)
        """``f``: the batch doubles while twice it is at most ``f`` times the noise scale."""

    def target(self, noise_scale: float) -> float:
        """The batch the rule aims at, ``f * B_noise`` (NaN without an estimate)."""
        if not math.isfinite(noise_scale) or noise_scale <= 0:
            return math.nan
        return self.fraction * noise_scale

    def decide(self, noise_scale: float, batch: int, ceiling: int) -> int | None:
        """The largest ``batch * 2**n`` (n >= 1) within both the target and the ceiling:
        a noise scale far above the batch is caught up with at once."""
        target = self.target(noise_scale)
        new = batch
        while 2 * new <= ceiling and 2 * new <= target:  # NaN compares False
            new *= 2
        return new if new > batch else None


class SeesawGrowth:
    """`decide(decay_factor, batch, start, ceiling)` -> twice `batch`, or None.

    ``decay_factor`` is the schedule's LR over its peak after warmup (1 during warmup):
    the ``n``-th doubling comes once it is at most ``2**-n``.
    """

    def decide(self, decay_factor: float, batch: int, start: int, ceiling: int) -> int | None:
        if 2 * batch > ceiling:
            return None
        n = doublings(batch, start) + 1
        return 2 * batch if decay_factor <= 0.5**n else None
