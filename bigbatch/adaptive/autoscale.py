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

The ``model`` rule (Pollux's worker count) grows by ``step`` until three sizes are
measured, two of them multi-worker, whether or not those growths paid (a fixed sync cost
can make two workers slower than one and eight faster), then fits Pollux's throughput model to them
(`bigbatch.adaptive.size_forecast`, `GoodputTuner`'s fit) and predicts samples/s and goodput
at every size not measured up to the ceiling. It jumps to the size of the best predicted
goodput when that beats the best measured size by more than ``margin`` (a larger size must
also keep the predicted marginal efficiency at or above ``threshold``), measures it, and
refits; sizes predicted to lose are never measured. A measurement always overrides the
prediction: the size the job settles on is a measured one (the best of the measured sizes,
each larger one accepted over a smaller only when its measured growth paid), never a
predicted one.

`Autoscaler` is the rule alone (numbers in, decisions out, every decision with the numbers
it was made on); `AutoscaleSegment` is the policy that runs in the workers of one
measured segment: it times each optimizer step, and at the segment's last step records
the measurement in ``metrics.jsonl`` and ends the run after a checkpoint, so the launcher
(`bigbatch.cli.autoscale`) can relaunch at the next size from that checkpoint.

The standard library, `bigbatch.adaptive.policy` and (the model rule)
`bigbatch.adaptive.size_forecast` only.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bigbatch.adaptive.policy import Policy
from bigbatch.adaptive.size_forecast import Forecast, fit_sizes, forecast_size, ready

__all__ = ["RULES", "UNTIL_ENV", "AutoscaleSegment", "Autoscaler", "Decision", "Measurement",
           "Plan", "even_split", "marginal_efficiency", "segment_policy"]

RULES = ("step", "model")
"""How the autoscaler picks the next size: grow step by step, or Pollux's model once fitted."""

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
    micro_batch_size: int = 0
    """Each worker's micro batch (0: unknown; the model rule needs it)."""
    k_steps: int = 1
    noise_scale: float = math.nan
    """The gradient noise scale at the segment's end (NaN: not tracked)."""

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
    rule: str = "step"
    """The rule that decided: ``step``, or ``model`` once the throughput model is fitted."""
    predicted: dict[int, float] = field(default_factory=dict)
    """The model rule: samples/s the fitted model predicts by worker count (measured sizes
    too, to read beside `measured`)."""
    predicted_goodput: dict[int, float] = field(default_factory=dict)
    forecast: float | None = None
    """The model rule: the samples/s predicted at `old` before it was measured."""

    def record(self, step: int) -> dict[str, Any]:
        """The decision as a ``metrics.jsonl`` line (kind ``autoscale``)."""
        out = {"kind": "autoscale", "step": int(step), **asdict(self)}
        for key in ("measured", "predicted", "predicted_goodput"):
            out[key] = {str(k): v for k, v in getattr(self, key).items()}
        return out


Plan = Callable[[int, Measurement], "tuple[int, int] | None"]
"""``plan(n, last)``: the (micro batch, k_steps) a segment at `n` workers would run after the
segment that measured `last` (``batch.elastic``'s split), None when the batch cannot run there."""


def even_split(n: int, last: Measurement) -> tuple[int, int] | None:
    """The default `Plan`: the last global batch split evenly over `n` workers, no merge."""
    b = last.global_batch_size
    return (b // n, 1) if b > 0 and b % n == 0 else None


class Autoscaler:
    """The decision rule over sizes ``lo..hi``; see the module docstring. ``rule``: ``step``
    or ``model``; ``margin``: the predicted relative goodput gain the model rule jumps for;
    ``plan`` (`Plan`) and ``base_batch_size`` (``B0`` of the efficiency): what the model
    predicts a size not measured at."""

    def __init__(self, lo: int, hi: int, *, step: int = 1, threshold: float = 0.5,
                 rule: str = "step", margin: float = 0.05, plan: Plan | None = None,
                 base_batch_size: int = 0) -> None:
        if not 1 <= lo <= hi:
            raise ValueError(f"worker range {lo}:{hi}: expected 1 <= MIN <= MAX")
        if step < 1:
            raise ValueError(f"step={step}: expected >= 1")
        if rule not in RULES:
            raise ValueError(f"rule={rule!r}: expected one of {', '.join(RULES)}")
        if margin < 0:
            raise ValueError(f"margin={margin}: expected >= 0")
        self.lo, self.hi, self.step, self.threshold = int(lo), int(hi), int(step), float(threshold)
        self.rule, self.margin = rule, float(margin)
        self.plan: Plan = plan or even_split
        self.base_batch_size = int(base_batch_size)
        self.ceiling = self.hi
        """The largest size still allowed (lowered by a growth that did not pay, or a loss)."""
        self.measured: dict[int, Measurement] = {}
        self.unusable: dict[int, str] = {}
        """Sizes a segment could not start at (the batch does not split over them), why."""
        self.forecasts: dict[int, Forecast] = {}
        """The model rule: the latest prediction by worker count."""
        self.jumped: list[int] = []
        """The model rule: sizes it jumped to on a prediction."""
        self.missed: int | None = None
        """The model rule: a size it jumped to whose measurement did not pay; from then on it
        steps up from the best measured size instead of jumping."""

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
        marginal = marginal_efficiency(self.measured[max(below)], m) if below else None
        if self.rule == "model" and ready(self.measured.values()):
            before = self.forecasts.get(n)
            head = f"measured {m.samples_per_s:.4g} samples/s at {n} workers"
            if before is not None:
                head += f" (predicted {before.samples_per_s:.4g})"
            if n in self.jumped and self.missed is None and self._accepted() is not m:
                self.missed = n
            return self._by_model(n, head, marginal,
                                  None if before is None else before.samples_per_s)
        if self.rule == "model":
            nxt = self._next(n)
            if nxt > n and nxt not in self.measured:
                how = "" if marginal is None else f", marginal scaling efficiency {marginal:.2f}"
                return Decision(n, nxt, False, f"grow {n} -> {nxt} workers: the model needs "
                                "three sizes measured, two of them on more than one worker "
                                f"({m.samples_per_s:.4g} samples/s at {n}{how})", marginal,
                                self._table())
        if below:
            a = self.measured[max(below)]
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

    # ------------------------------------------------------------- the model rule

    def _accepted(self) -> Measurement:
        """The measured size the model rule stands on: from the smallest measured, each
        larger measured size replaces it when its growth paid (marginal efficiency at or
        above the threshold and more goodput), as the step rule's growths do."""
        sizes = sorted(k for k in self.measured if k <= self.ceiling) or sorted(self.measured)
        cur = self.measured[sizes[0]]
        for k in sizes[1:]:
            b = self.measured[k]
            if marginal_efficiency(cur, b) >= self.threshold and b.goodput > cur.goodput:
                cur = b
        return cur

    def _by_model(self, old: int, head: str, marginal: float | None,
                  forecast: float | None) -> Decision:
        """Fit the model to what was measured, predict every size on the step grid up to
        the ceiling, and jump to the predicted best or settle at the best measured."""
        params = fit_sizes(self.measured.values())
        last = max(self.measured.values(), key=lambda x: x.step)
        noise = next((x.noise_scale for x in sorted(self.measured.values(),
                                                    key=lambda x: -x.step)
                      if math.isfinite(x.noise_scale)), math.nan)
        self.forecasts = {}
        for n in range(self.lo, self.ceiling + 1, self.step):
            split = None if n in self.unusable else self.plan(n, last)
            if split is not None:
                self.forecasts[n] = forecast_size(params, n, *split, noise,
                                                  self.base_batch_size)
        b = self._accepted()
        wins, losers = [], []
        for n, f in sorted(self.forecasts.items()):
            if n in self.measured:
                continue
            gain = f.goodput / b.goodput - 1.0 if b.goodput > 0 else math.inf
            pays = n < b.world_size or marginal_efficiency(
                b, Measurement(n, f.samples_per_s, 0)) >= self.threshold
            (wins if gain > self.margin and pays else losers).append(f)
        pred = {n: round(f.samples_per_s, 3) for n, f in self.forecasts.items()}
        good = {n: round(f.goodput, 3) for n, f in self.forecasts.items()}
        out = {"marginal": marginal, "measured": self._table(), "rule": "model",
               "predicted": pred, "predicted_goodput": good, "forecast": forecast}
        skipped = (f"; not measured (predicted to lose): "
                   f"{', '.join(str(f.world_size) for f in losers)}" if losers else "")
        if self.missed is not None:
            return self._step_from(old, b, head, out)
        if wins:
            t = max(wins, key=lambda f: (f.goodput, -f.world_size))
            gain = t.goodput / b.goodput - 1.0
            self.jumped.append(t.world_size)
            return Decision(old, t.world_size, False, f"{head}; jump to {t.world_size} "
                            f"workers: predicted {t.samples_per_s:.4g} samples/s, goodput "
                            f"{t.goodput:.4g}, {gain:+.1%} over the best measured "
                            f"({b.world_size} workers, goodput {b.goodput:.4g}; margin "
                            f"{self.margin:.0%}){skipped}", **out)
        top = max((f for f in self.forecasts.values() if f.world_size not in self.measured),
                  key=lambda f: (f.goodput, -f.world_size), default=None)
        why = ("every size on the grid measured" if top is None else
               f"no size not measured is predicted to beat it by more than {self.margin:.0%} "
               f"at a marginal efficiency >= {self.threshold:.2f} (best predicted "
               f"{top.world_size} workers: {top.samples_per_s:.4g} samples/s, goodput "
               f"{top.goodput:.4g})")
        return Decision(old, b.world_size, True, f"{head}; settle at {b.world_size} workers "
                        f"(best measured: {b.samples_per_s:.4g} samples/s, goodput "
                        f"{b.goodput:.4g}): {why}{skipped}", **out)

    def _step_from(self, old: int, b: Measurement, head: str, out: dict[str, Any]) -> Decision:
        """After a missed jump: the next size above the best measured, as the step rule
        grows, until that size is one already measured (it did not pay): settle."""
        m = self.measured[self.missed]
        why = (f"the jump to {self.missed} workers did not pay (measured goodput "
               f"{m.goodput:.4g}), so the model no longer skips sizes")
        nxt = self._next(b.world_size)
        out = {**out, "rule": "step"}
        if nxt > b.world_size and nxt not in self.measured:
            return Decision(old, nxt, False, f"{head}; {why}: grow {b.world_size} -> {nxt} "
                            f"workers from the best measured", **out)
        return Decision(old, b.world_size, True, f"{head}; {why}; settle at {b.world_size} "
                        f"workers (best measured: {b.samples_per_s:.4g} samples/s, goodput "
                        f"{b.goodput:.4g})", **out)

    # ------------------------------------------------------------- failures

    def cannot_start(self, n: int, why: str) -> Decision:
        """A segment could not start at `n` workers (`why`: its one-line error, such as a
        global batch that does not split over `n`): try the next size, else settle."""
        self.unusable[n] = why
        if self.rule == "model" and ready(self.measured.values()):
            return self._by_model(n, f"{n} workers cannot run this job ({why})", None, None)
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
                             "global_batch_size": batch,
                             "micro_batch_size": int(run.plan.micro_batch_size),
                             "k_steps": int(run.k_steps), "noise_scale": noise,
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
