"""Choosing a job's worker count from measured throughput (Or et al. 2020, "Resource
Elasticity in Distributed Deep Learning", MLSys; the goodput of Pollux, Qiao et al. 2021).

The job starts at the smallest size, measures examples per second there, and grows by
``step`` workers while each growth pays: the *marginal scaling efficiency* of going from
``a`` to ``b`` workers,

    marginal(a -> b) = (X(b) - X(a)) / ((b - a) X(a) / a)

(the throughput the added workers bring, as a share of what ``b - a`` more workers at
``a``'s per-worker rate would bring; 1 = linear scaling, 0 = nothing gained, negative =
slower), must stay at or above ``threshold`` *and* goodput ``X(b) E(B_b)`` must beat
``X(a) E(B_a)`` (``E`` Pollux's statistical efficiency, 1 when the noise scale is unknown or
the global batch does not change with the size, as under ``batch.elastic = "keep"``).
When a growth does not pay, the job goes back to the best size measured and stays there;
a lost worker shrinks it by one and caps the size.

`Autoscaler` is the rule alone (numbers in, decisions out, every decision with the numbers
it was made on); `AutoscaleSegment` is the policy that runs in the workers of one
measured segment: it times each optimizer step, and at the segment's last step records
the measurement in ``metrics.jsonl`` and ends the run after a checkpoint, so the launcher
(`bigbatch.cli.autoscale`) can relaunch at the next size from that checkpoint.

Pure: the standard library and `bigbatch.adaptive.policy` only.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bigbatch.adaptive.policy import Policy

__all__ = ["UNTIL_ENV", "AutoscaleSegment", "Autoscaler", "Decision", "Measurement",
           "marginal_efficiency", "segment_policy"]

UNTIL_ENV = "BIGBATCH_AUTOSCALE_UNTIL"
"""Set by the launcher for a measured segment: the optimizer step at which it ends."""
SKIP_ENV = "BIGBATCH_AUTOSCALE_SKIP"
"""Steps at the start of a segment left out of its timing (start-up, first collectives)."""


@dataclass(frozen=True)
class Measurement:
    """What one segment measured at one size."""

    world_size: int
    samples_per_s: float
    """Global batch over the median seconds between optimizer steps (data, compute, sync)."""
    step: int
    """The optimizer step the segment ended at."""
    global_batch_size: int = 0
    efficiency: float = 1.0
    """Pollux's statistical efficiency of the segment's global batch (1: unknown/unchanged)."""

    @property
    def goodput(self) -> float:
        return self.samples_per_s * self.efficiency


def marginal_efficiency(a: Measurement, b: Measurement) -> float:
    """Share of linear scaling that going from `a` to `b` (more workers) delivered."""
    per_worker = a.samples_per_s / a.world_size
    added = b.world_size - a.world_size
    if added == 0 or per_worker <= 0:
        return math.nan
    return (b.samples_per_s - a.samples_per_s) / (added * per_worker)


@dataclass(frozen=True)
class Decision:
    """One decision of `Autoscaler`: the size to run next and why."""

    old: int
    new: int
    settled: bool
    """The size stays for the rest of the run (no more measuring)."""
    reason: str
    marginal: float | None = None
    measured: dict[int, float] = field(default_factory=dict)
    """Samples per second by worker count, all measured so far."""

    def record(self, step: int) -> dict[str, Any]:
        """The decision as a ``metrics.jsonl`` line (kind ``autoscale``)."""
        out = {"kind": "autoscale", "step": int(step), **asdict(self)}
        out["measured"] = {str(k): v for k, v in self.measured.items()}
        return out


class Autoscaler:
    """The decision rule over sizes ``lo..hi``; see the module docstring."""

    def __init__(self, lo: int, hi: int, *, step: int = 1, threshold: float = 0.5) -> None:
        if not 1 <= lo <= hi:
            raise ValueError(f"worker range {lo}:{hi}: expected 1 <= MIN <= MAX")
        if step < 1:
            raise ValueError(f"step={step}: expected >= 1")
        self.lo, self.hi, self.step, self.threshold = int(lo), int(hi), int(step), float(threshold)
        self.ceiling = self.hi
        """The largest size still allowed (lowered by a growth that did not pay, or a loss)."""
        self.measured: dict[int, Measurement] = {}
        self.unusable: dict[int, str] = {}
        """Sizes a segment could not start at (the batch does not split over them), why."""

    def _table(self) -> dict[int, float]:
        return {n: round(m.samples_per_s, 3) for n, m in sorted(self.measured.items())}

    def _best(self) -> int:
        allowed = [m for n, m in self.measured.items() if n <= self.ceiling]
        if not allowed:
            return min(self.ceiling, max(self.lo, min(self.measured, default=self.lo)))
        # Equal goodput: fewer workers.
        return max(allowed, key=lambda m: (m.goodput, -m.world_size)).world_size

    def observe(self, m: Measurement) -> Decision:
        """The segment at ``m.world_size`` measured `m`: where to go next."""
        n = m.world_size
        self.measured[n] = m
        below = [k for k in self.measured if k < n]
        marginal = None
        if below:
            a = self.measured[max(below)]
            marginal = marginal_efficiency(a, m)
            gained = m.goodput > a.goodput
            if not (marginal >= self.threshold and gained):
                self.ceiling = min(self.ceiling, a.world_size)
                best = self._best()
                why = (f"marginal scaling efficiency {a.world_size} -> {n} workers "
                       f"{marginal:.2f} < threshold {self.threshold:.2f}"
                       if marginal < self.threshold else
                       f"goodput {m.goodput:.4g} did not beat {a.goodput:.4g} at "
                       f"{a.world_size} workers")
                return Decision(n, best, True, f"settle at {best} workers (best measured "
                                f"throughput {self.measured[best].samples_per_s:.4g} "
                                f"samples/s): {why}", marginal, self._table())
        nxt = self._next(n)
        if nxt > n and nxt not in self.measured:
            what = (f"marginal scaling efficiency {marginal:.2f} >= {self.threshold:.2f} "
                    "and goodput improved" if marginal is not None else "first size measured")
            return Decision(n, nxt, False, f"grow {n} -> {nxt} workers: {what} "
                            f"({m.samples_per_s:.4g} samples/s at {n})", marginal, self._table())
        best = self._best()
        return Decision(n, best, True, f"settle at {best} workers: "
                        f"{'the largest allowed size' if nxt <= n else 'every size measured'}"
                        f", best measured throughput "
                        f"{self.measured[best].samples_per_s:.4g} samples/s", marginal,
                        self._table())

    def _next(self, n: int) -> int:
        """The size after `n`: `step` more, past sizes that could not start; `n` if none."""
        k = n + self.step
        while k in self.unusable:
            k += 1
        return k if k <= self.ceiling else n

    def cannot_start(self, n: int, why: str) -> Decision:
        """A segment could not start at `n` workers (`why`: its one-line error, such as a
        global batch that does not split over `n`): try the next size, else settle."""
        self.unusable[n] = why
        below = [k for k in self.measured if k < n]
        nxt = self._next(max(below)) if below else n
        if nxt > n and nxt not in self.measured:
            return Decision(n, nxt, False, f"{n} workers cannot run this job ({why}); try "
                            f"{nxt}", None, self._table())
        best = self._best()
        return Decision(n, best, True, f"{n} workers cannot run this job ({why}); settle at "
                        f"{best} workers, the best measured", None, self._table())

    def lost_worker(self, n: int) -> Decision:
        """A worker of the size-`n` job was lost: continue one smaller (at least ``lo``)."""
        new = max(self.lo, n - 1)
        self.ceiling = min(self.ceiling, new)
        return Decision(n, new, new == self.lo or new in self.measured,
                        f"a worker was lost at {n} workers: continue at {new} from the last "
                        "checkpoint", None, self._table())


class AutoscaleSegment(Policy):
    """``autoscale``: in the workers of a measured segment (the launcher sets `UNTIL_ENV`),
    time the steps and, at step ``until``, record the throughput and stop after a
    checkpoint. Its decisions are the launcher's; this only measures."""

    name = "autoscale"

    def __init__(self, until: int, skip: int = 2) -> None:
        self.until, self.skip = int(until), int(skip)
        self._last: float | None = None
        self._intervals: list[float] = []

    def after_step(self, run: Any, stats: dict[str, float]) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now
        if run.step < self.until:
            return
        timed = self._intervals[self.skip:] or self._intervals
        batch = int(stats.get("global_batch_size", run.plan.global_batch_size))
        median = statistics.median(timed) if timed else math.nan
        sps = batch / median if timed and median > 0 else math.nan
        noise, eff = math.nan, 1.0
        ctl = getattr(run, "adaptive", None)
        if ctl is not None and getattr(ctl, "tracker", None) is not None:
            ctl.flush()
            noise = float(ctl.tracker.b_simple)
            if math.isfinite(noise) and noise > 0:
                base = run.strategy.batch.base_batch_size
                eff = (noise + base) / (noise + batch)
        n = run.world.world_size
        run.policies.record({"kind": "autoscale_measure", "step": run.step, "world_size": n,
                             "samples_per_s": sps, "step_s": median, "timed_steps": len(timed),
                             "global_batch_size": batch, "noise_scale": noise,
                             "efficiency": eff})
        run.policies.request_stop(f"autoscale: {n} worker(s) measured {sps:.4g} samples/s "
                                  f"over {len(timed)} steps; checkpoint at step {run.step}", 0)


def segment_policy() -> AutoscaleSegment | None:
    """The segment policy when the launcher asked for one (`UNTIL_ENV`), else None."""
    until = os.environ.get(UNTIL_ENV, "")
    if not until.isdigit():
        return None
    skip = os.environ.get(SKIP_ENV, "2")
    return AutoscaleSegment(int(until), int(skip) if skip.isdigit() else 2)
