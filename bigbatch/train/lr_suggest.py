"""Reading an LR range test's curve: smoothing, divergence, the suggested peak LR, or none.

Pure functions over the swept LRs and their losses (no torch), shared by the range test
(`bigbatch.train.lr_range`, which stops the sweep with `diverged`) and by what reads a
finished sweep (`suggest`).

- **Smoothing** is a centred moving average whose half-width grows with the sweep
  (``max(1, round(n / 20))`` points): it does not lag behind the curve as an exponential
  average does on a sweep of a few dozen steps (fastai's 0.98 lags by ~50 steps).
- **Divergence**, judged as the sweep goes on a trailing mean of 3 losses: the first
  step whose loss is not finite, or ``diverge`` x the best so far, or back above where
  the sweep started after a clear descent (a cross-entropy that returns to chance level
  from 1.5 never reaches 4x).
- **The suggestion** is the LR at the smoothed minimum before divergence divided by a
  safety factor (`SAFETY`, 2), not the steepest descent (fastai's default): on a sweep
  of 15-30 steps from the initial weights the steepest point sits well below the
  largest LR that still trains. A schedule holds its peak for many steps, through
  curvature that grows as the loss falls: LARS with Fleet's untuned recipe at 8192 on
  MNIST-1D lost 27 points at the minimum itself, and 1, 2 and 4 points at 1.5, 3 and 4
  against 2 (benchmarks/NOTES-lr-find.md). Where the rule helped and where it did not:
  docs/lr-find-study.md.
- **No clear descent** (a flat curve, one that rises from the first step, or a drop no
  larger than 3x the curve's own noise, measured where the loss is not above its start): no suggestion; the caller falls back (the trainer
  to the scaled base LR) and says so in one line.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DIVERGE", "SAFETY", "Suggestion", "diverged", "smooth", "suggest"]

SAFETY = 2.0
"""The suggested peak LR is the smoothed minimum's LR divided by this."""
DIVERGE = 4.0
"""A smoothed loss above this multiple of its best so far has diverged (fastai, Lightning)."""
_MIN_POINTS = 5


@dataclass(frozen=True)
class Suggestion:
    """What a range test's curve says."""

    lr: float | None
    """The suggested peak LR; None: no clear descent (fall back)."""
    reason: str
    """One line: how `lr` was chosen, or why there is none."""
    smoothed: tuple[float, ...]
    """The smoothed losses (as many as the finite losses)."""
    minimum_lr: float | None = None
    """The LR at the smoothed minimum before divergence."""
    diverged_index: int | None = None
    """The first diverged point (None: none diverged)."""


def smooth(losses: Sequence[float]) -> list[float]:
    """The centred moving average of `losses`, half-width ``max(1, round(n / 20))``,
    truncated at both ends (so the first and last points are not pulled inward)."""
    n = len(losses)
    k = max(1, round(n / 20))
    out = []
    for i in range(n):
        lo, hi = max(0, i - k), min(n, i + k + 1)
        half = min(i - lo, hi - 1 - i)  # symmetric at the ends: no lag there either
        window = losses[i - half:i + half + 1]
        out.append(sum(window) / len(window))
    return out


def _noise(losses: Sequence[float], smoothed: Sequence[float]) -> float:
    """The curve's own noise: the median absolute residual around its smoothing, over
    the points not above the first (a loss blowing up past the minimum is not noise:
    on a 15-step sweep of SGD it is half the points), or over all when that leaves < 3."""
    pairs = list(zip(losses, smoothed, strict=True))
    calm = [(a, b) for a, b in pairs if a <= losses[0]]
    return statistics.median(abs(a - b) for a, b in (calm if len(calm) >= 3 else pairs))


def diverged(losses: Sequence[float], diverge: float = DIVERGE) -> int | None:
    """The index of the first diverged point of `losses`, judged as the sweep goes (each
    point from those before it and a trailing mean of 3), or None."""
    best, start = math.inf, None
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return i
        window = losses[max(0, i - 2):i + 1]
        now = sum(window) / len(window)
        if start is None:
            start = now
        if i >= 3 and (now > diverge * best
                       or (best < start - 0.25 * abs(start) and now > start)):
            return i
        best = min(best, now)
    return None


def suggest(lrs: Sequence[float], losses: Sequence[float], *, safety: float = SAFETY,
            diverge: float = DIVERGE) -> Suggestion:
    """The suggested peak LR of a sweep (`lrs` increasing, `losses` the loss at each).

    The smoothed minimum before divergence, over `safety`; None with the reason when the
    curve shows no descent larger than 3x its noise and 2% of its start.
    """
    if len(lrs) != len(losses):
        raise ValueError(f"suggest: {len(lrs)} LRs but {len(losses)} losses")
    stop = diverged(losses, diverge)
    finite = [x for x in losses[:stop] if math.isfinite(x)]
    n = len(finite)
    if n < _MIN_POINTS:
        return Suggestion(None, f"only {n} points before the loss diverged; nothing to read",
                          tuple(smooth(finite)) if finite else (), diverged_index=stop)
    s = smooth(finite)
    m = min(range(n), key=s.__getitem__)
    drop = s[0] - s[m]
    noise = _noise(finite, s)
    if m == 0 or drop <= max(3 * noise, 0.02 * abs(s[0])):
        what = "rose from the first step" if m == 0 and stop is not None else "showed no clear descent"
        return Suggestion(None, f"the loss {what} (drop {drop:.3g}, noise {noise:.3g})",
                          tuple(s), diverged_index=stop)
    lr = lrs[m] / safety
    if stop is not None and stop < len(lrs):
        where = f"before divergence at {lrs[stop]:.3g}"
    elif m == n - 1:
        where = "at the sweep's top: the loss still fell there, a larger LR may do"
    else:
        where = f"the loss rose after it, without diverging up to {lrs[n - 1]:.3g}"
    return Suggestion(lr, f"smoothed minimum at {lrs[m]:.3g} {where}; / {safety:g}",
                      tuple(s), minimum_lr=lrs[m], diverged_index=stop)
