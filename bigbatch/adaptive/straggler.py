"""Straggler detection and rebalancing, as pure arithmetic on per-rank times.

A rank is slow in a window when its compute time exceeds ``threshold`` times the
median of the *other* ranks' compute times (so a 2-rank job can flag one: the
median of one other rank is that rank). It is flagged once it has been slow for
``patience`` consecutive windows ("Resource Elasticity in Distributed Deep
Learning", Hasan et al. 2020, detect stragglers by such relative step times).

Rebalancing gives each rank a share of the step's samples proportional to its
measured speed (samples per second of compute), within bounds, so that all
ranks finish their compute at about the same time while the global batch stays.

The engine's glue (timing, gathering, actions) is `bigbatch.engine.straggler`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["ACTIONS", "EXIT_STRAGGLER", "StragglerDetector", "apportion", "rebalance",
           "slowness"]

ACTIONS = ("warn", "rebalance", "stop")
EXIT_STRAGGLER = 75
"""Exit status of a run stopped by ``[straggler] action = "stop"`` (sysexits' EX_TEMPFAIL:
retry, here without the slow node), after its checkpoint."""


def slowness(compute: Sequence[float]) -> list[float]:
    """Each rank's compute time over the median of the other ranks' (nan for one rank or
    a median of 0)."""
    out = []
    for r, mine in enumerate(compute):
        others = [c for q, c in enumerate(compute) if q != r]
        med = statistics.median(others) if others else 0.0
        out.append(mine / med if med > 0 else math.nan)
    return out


class StragglerDetector:
    """Per-rank streaks of slow windows; `update` returns the ranks flagged just now."""

    def __init__(self, threshold: float = 1.5, patience: int = 2) -> None:
        if not threshold > 1:
            raise ConfigError(f"straggler.threshold={threshold} is out of range; allowed: > 1")
        if patience < 1:
            raise ConfigError(f"straggler.patience={patience} is out of range; allowed: >= 1")
        self.threshold = float(threshold)
        self.patience = int(patience)
        self.streaks: list[int] = []
        """Consecutive slow windows per rank, up to now."""
        self.last_ratios: list[float] = []
        """The latest window's `slowness`."""

    def update(self, compute: Sequence[float]) -> list[int]:
        """Feed one window's compute times (one per rank); the ranks whose streak reached
        `patience` in this window (flagged once per streak)."""
        if len(self.streaks) != len(compute):
            self.streaks = [0] * len(compute)
        self.last_ratios = slowness(compute)
        flagged = []
        for r, ratio in enumerate(self.last_ratios):
            self.streaks[r] = self.streaks[r] + 1 if ratio > self.threshold else 0
            if self.streaks[r] == self.patience:
                flagged.append(r)
        return flagged

    @property
    def slow(self) -> list[int]:
        """Ranks flagged and still slow."""
        return [r for r, s in enumerate(self.streaks) if s >= self.patience]

    def reset(self) -> None:
        """Forget the streaks (after the ranks' loads changed)."""
        self.streaks = [0] * len(self.streaks)

    def state_dict(self) -> dict[str, Any]:
        return {"streaks": list(self.streaks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streaks = [int(s) for s in state["streaks"]]


def apportion(weights: Sequence[float], total: int, lo: int, hi: int) -> list[int]:
    """Integers in ``[lo, hi]`` summing to `total`, as close to proportional to `weights`
    as the bounds allow (bounded shares first, then the largest remainders)."""
    n = len(weights)
    if not n * lo <= total <= n * hi:
        raise ValueError(f"{n} shares in [{lo}, {hi}] cannot sum to {total}")
    w = [max(float(x), 0.0) if math.isfinite(x) else 0.0 for x in weights]
    if sum(w) <= 0:
        w = [1.0] * n
    target = [0.0] * n
    free = set(range(n))
    left = float(total)
    while free:  # pin shares that hit a bound, spread what is left over the rest
        scale = left / sum(w[i] for i in free) if sum(w[i] for i in free) > 0 else 0.0
        pinned = {}
        for i in free:
            t = w[i] * scale if scale else left / len(free)
            if t < lo or t > hi:
                pinned[i] = lo if t < lo else hi
        if not pinned:
            for i in free:
                target[i] = w[i] * scale if scale else left / len(free)
            break
        for i, v in pinned.items():
            target[i] = float(v)
            left -= v
            free.discard(i)
    out = [min(hi, max(lo, math.floor(t))) for t in target]
    rest = total - sum(out)
    order = sorted(range(n), key=lambda i: target[i] - math.floor(target[i]), reverse=True)
    while rest:
        moved = False
        for i in order:
            if rest > 0 and out[i] < hi:
                out[i] += 1
                rest -= 1
                moved = True
            elif rest < 0 and out[i] > lo:
                out[i] -= 1
                rest += 1
                moved = True
            if not rest:
                break
        if not moved:  # unreachable within the bounds checked above
            raise ValueError(f"cannot apportion {total} in [{lo}, {hi}]")
    return out


def rebalance(shares: Sequence[int], compute: Sequence[float], max_factor: float = 2.0
              ) -> list[int]:
    """New per-rank micro batches: each rank's samples per second of compute decide its
    share of ``sum(shares)``; none below 1 or above ``max_factor`` x the even share (the
    memory a faster rank may use)."""
    total = int(sum(shares))
    n = len(shares)
    speeds = [s / c if c > 0 else math.inf for s, c in zip(shares, compute, strict=True)]
    if any(math.isinf(v) for v in speeds):  # no measurement for some rank: stay even
        speeds = [1.0] * n
    hi = max(math.ceil(total / n), math.floor(max_factor * total / n))
    return apportion(speeds, total, 1, hi)
