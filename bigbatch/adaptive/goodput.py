"""Goodput-driven batch size (Qiao et al. 2021, "Pollux: Co-adaptive Cluster Scheduling for
Goodput-Optimized Deep Learning", OSDI).

goodput(B) = throughput(B) * efficiency(B): examples per second, discounted by how much an
example at batch ``B`` is worth compared with one at the base batch ``B0``.

**Throughput** (Pollux eq. 9-11, one node kind): a micro-step of ``m`` examples computes for
``T_grad(m) = alpha_c + beta_c m`` seconds; on ``n > 1`` workers the gradient sync takes
``T_sync(n) = alpha_n + beta_n (n - 2)`` (Pollux's form: ``alpha_n`` is the sync
on two workers) and overlaps the last micro-step's backward pass,
so one optimizer step with ``k`` merge steps takes::

    T(m, k, n) = (k - 1) T_grad + (T_grad^gamma + T_sync^gamma)^(1 / gamma)

``gamma = 1``: no overlap (times add); ``gamma -> inf``: perfect overlap (the max). The
global batch is ``B = m k n``. `fit_throughput` fits the five numbers to measured step times
(relative least squares: Levenberg-Marquardt on log times, a grid over ``gamma``). What the
samples cannot tell apart is fixed as Pollux/AdaptDL do: one micro-batch size seen ->
``alpha_c = beta_c m`` (half fixed, half per example); no multi-worker sample -> no sync;
one worker count seen -> ``beta_n = 0``; no multi-worker sample at two micro sizes ->
``gamma = 1``. A micro-step without sync (all but the last under gradient merge) is a
sample ``(m, 1, 1, seconds)`` and pins the compute time down on its own.

**Statistical efficiency** (Pollux eq. 6, from McCandlish et al.'s noise scale)::

    E(B) = (B_noise + B0) / (B_noise + B)

the fraction of a base-batch step's progress that each example still makes at batch
``B``; equal to AdaScale's ``gain / scale``.

`GoodputTuner.suggest` searches every ``(m, k)`` with ``m`` up to the memory limit and
``B`` within ``[min_batch_size, max_batch_size]`` on the current world size, or, given
``worlds``, every ``(m, k, n)`` over those worker counts (Pollux's resource half: the job's
size is chosen with its batch; the LR follows the batch through ``batch.scaling``), and
moves only when the best predicted goodput beats the current one by more than
``threshold``. Every suggestion carries a human-readable ``reason``.

The throughput model and its fit live in `bigbatch.adaptive.throughput` and are re-exported here.
"""

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bigbatch.adaptive.throughput import ThroughputParams, fit_throughput, step_time
from bigbatch.errors import ConfigError

__all__ = [
    "GoodputTuner",
    "Suggestion",
    "ThroughputParams",
    "efficiency",
    "fit_throughput",
    "goodput",
    "step_time",
]


def efficiency(batch: Any, noise_scale: float, base_batch: int) -> Any:
    """``(B_noise + B0) / (B_noise + B)``; ``inf`` noise scale: 1; negative counts as 0."""
    b = np.asarray(batch, dtype=np.float64)
    if math.isinf(noise_scale):
        out = np.ones_like(b)
    else:
        phi = max(float(noise_scale), 0.0)
        out = (phi + base_batch) / (phi + b)
    return float(out) if out.ndim == 0 else out


def goodput(
    params: ThroughputParams, micro: Any, k: Any, world: Any, noise_scale: float, base_batch: int
) -> Any:
    """Examples per second times `efficiency`: base-batch-equivalent examples per second."""
    batch = np.asarray(micro, np.float64) * np.asarray(k, np.float64) * np.asarray(world)
    out = batch / step_time(params, micro, k, world) * efficiency(batch, noise_scale, base_batch)
    return float(out) if np.ndim(out) == 0 else out


# ----------------------------------------------------------------------------- tuner


@dataclass(frozen=True)
class Suggestion:
    """A batch-size decision of `GoodputTuner.suggest`."""

    global_batch_size: int
    """Suggested global batch ``micro * k_steps * world_size``."""
    micro_batch_size: int
    """Suggested per-worker micro batch."""
    k_steps: int
    """Suggested gradient-merge steps."""
    world_size: int
    """Workers: unchanged unless `GoodputTuner.suggest` was given ``worlds`` to choose from."""
    changed: bool
    """Whether this differs from the configuration passed in."""
    goodput: float
    """Predicted goodput of the suggestion (NaN when no model is fitted)."""
    current_goodput: float
    """Predicted goodput of the configuration passed in."""
    reason: str
    """One line saying why, for the log."""


def _describe(m: int, k: int, n: int) -> str:
    return f"{m * k * n} (micro {m} x {k} merge x {n} workers)"


class GoodputTuner:
    """Records step times, fits the throughput model, suggests the goodput-optimal batch.

    ``base_batch_size``: ``B0`` of the efficiency; ``min_batch_size`` / ``max_batch_size``:
    the allowed global batch; ``max_micro_batch_size``: largest micro batch that fits in
    memory; ``threshold``: relative goodput gain needed to move (``adaptive.gain_threshold``);
    ``micro_batch_sizes``: allowed micro batches (default every size up to the maximum).
    """

    def __init__(
        self,
        base_batch_size: int,
        *,
        min_batch_size: int,
        max_batch_size: int,
        max_micro_batch_size: int,
        threshold: float = 0.05,
        micro_batch_sizes: Sequence[int] | None = None,
    ):
        for key, value in (
            ("batch.base_batch_size", base_batch_size),
            ("adaptive.min_batch_size", min_batch_size),
            ("adaptive.max_batch_size", max_batch_size),
            ("max_micro_batch_size", max_micro_batch_size),
        ):
            if value < 1:
                raise ConfigError(f"{key}={value} is out of range; allowed: >= 1")
        if min_batch_size > max_batch_size:
            raise ConfigError(
                f"adaptive.min_batch_size={min_batch_size} is larger than "
                f"adaptive.max_batch_size={max_batch_size}"
            )
        if threshold < 0:
            raise ConfigError(f"adaptive.gain_threshold={threshold} is out of range; allowed: >= 0")
        self.base_batch_size = int(base_batch_size)
        self.min_batch_size = int(min_batch_size)
        self.max_batch_size = int(max_batch_size)
        self.max_micro_batch_size = int(max_micro_batch_size)
        self.threshold = float(threshold)
        sizes = (
            range(1, self.max_micro_batch_size + 1)
            if micro_batch_sizes is None
            else micro_batch_sizes
        )
        self.micro_batch_sizes = sorted(
            {int(s) for s in sizes if 1 <= s <= self.max_micro_batch_size}
        )
        if not self.micro_batch_sizes:
            raise ConfigError(
                f"micro_batch_sizes has no size in 1..max_micro_batch_size={max_micro_batch_size}"
            )
        self.params: ThroughputParams | None = None
        """Latest fitted throughput model (None before the first fit)."""
        self._samples: dict[tuple[int, int, int], list[float]] = {}  # -> [count, total seconds]

    def record(self, micro: int, k_steps: int, world_size: int, seconds: float) -> None:
        """Add one measured optimizer step (skip the first steps after a change: warm-up)."""
        if seconds > 0 and math.isfinite(seconds):
            entry = self._samples.setdefault((int(micro), int(k_steps), int(world_size)), [0, 0.0])
            entry[0] += 1
            entry[1] += float(seconds)

    @property
    def samples(self) -> list[tuple[int, int, int, float, int]]:
        """``(micro, k, world, mean seconds, count)`` per configuration seen."""
        return [(*key, tot / cnt, int(cnt)) for key, (cnt, tot) in sorted(self._samples.items())]

    def fit(self) -> ThroughputParams | None:
        """Refit the throughput model to all samples (None without samples)."""
        if self._samples:
            rows = self.samples
            self.params = fit_throughput([r[:4] for r in rows], weights=[r[4] for r in rows])
        return self.params

    def candidates(self, world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """All ``(micro, k)`` arrays with ``min <= micro * k * world <= max`` batches."""
        ms, ks = [], []
        for m in self.micro_batch_sizes:
            k_lo = max(1, -(-self.min_batch_size // (m * world_size)))
            k_hi = self.max_batch_size // (m * world_size)
            if k_hi >= k_lo:
                ks.append(np.arange(k_lo, k_hi + 1))
                ms.append(np.full(k_hi - k_lo + 1, m))
        if not ms:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(ms), np.concatenate(ks)

    def suggest(
        self, micro: int, k_steps: int, world_size: int, noise_scale: float, *,
        refit: bool = True, worlds: Sequence[int] | None = None,
    ) -> Suggestion:
        """Best ``(micro, k)`` for ``world_size`` given the noise scale (``b_simple``), or
        best ``(micro, k, n)`` over the worker counts ``worlds`` when given.

        Keeps the current configuration unless the best predicted goodput exceeds the
        current one by more than ``threshold`` (hysteresis against noise in the estimates).
        Between equal goodputs the fewer workers win (the same progress for fewer machines).
        A model fitted without multi-worker samples predicts no sync cost: the caller
        should offer only worker counts it has measured or the next one (`Autoscaler`).
        """
        cur = (int(micro), int(k_steps), int(world_size))

        def keep(reason: str, good: float = math.nan, cur_good: float = math.nan) -> Suggestion:
            return Suggestion(cur[0] * cur[1] * cur[2], *cur, False, good, cur_good, reason)

        params = self.fit() if refit else self.params
        if params is None:
            return keep(f"keep batch {_describe(*cur)}: no step times recorded yet")
        if math.isnan(noise_scale):
            return keep(f"keep batch {_describe(*cur)}: no gradient noise scale estimate yet")
        base = self.base_batch_size
        ns_all = sorted({int(n) for n in worlds}) if worlds else [int(world_size)]
        if ns_all[0] < 1:
            raise ConfigError(f"worlds={list(worlds or [])}: worker counts must be >= 1")
        parts = [(*self.candidates(n), n) for n in ns_all]
        ms = np.concatenate([m for m, _, _ in parts])
        ks = np.concatenate([k for _, k, _ in parts])
        ns = np.concatenate([np.full(m.size, n) for m, _, n in parts])
        cur_good = goodput(params, *cur, noise_scale, base)
        if ms.size == 0:
            return keep(
                f"keep batch {_describe(*cur)}: no micro/merge split of "
                f"{'/'.join(map(str, ns_all))} workers gives a batch in "
                f"[{self.min_batch_size}, {self.max_batch_size}]",
                cur_good,
                cur_good,
            )
        goods = goodput(params, ms, ks, ns, noise_scale, base)
        # Ties (e.g. infinite noise scale at max throughput) go to fewer workers, then to
        # the larger micro batch.
        i = int(np.lexsort((-ms, ns, -np.round(goods / goods.max(), 12)))[0])
        best = (int(ms[i]), int(ks[i]), int(ns[i]))
        best_good = float(goods[i])
        gain = best_good / cur_good - 1.0 if cur_good > 0 else math.inf
        noise = "inf" if math.isinf(noise_scale) else f"{noise_scale:.4g}"

        def thr(c: tuple[int, int, int]) -> float:
            return c[0] * c[1] * c[2] / step_time(params, *c)

        def eff(c: tuple[int, int, int]) -> float:
            return efficiency(c[0] * c[1] * c[2], noise_scale, base)

        detail = (
            f"predicted goodput {cur_good:.4g} -> {best_good:.4g} ex/s ({gain:+.1%}) = "
            f"throughput {thr(cur):.4g} -> {thr(best):.4g} ex/s x efficiency "
            f"{eff(cur):.3f} -> {eff(best):.3f} (noise scale {noise}, base batch {base})"
        )
        b_cur = cur[0] * cur[1] * cur[2]
        bad = []
        if not self.min_batch_size <= b_cur <= self.max_batch_size:
            bad.append(f"batch outside [{self.min_batch_size}, {self.max_batch_size}]")
        if cur[0] > self.max_micro_batch_size:
            bad.append(f"micro above the memory limit {self.max_micro_batch_size}")
        if bad:
            return Suggestion(
                best[0] * best[1] * best[2],
                *best,
                True,
                best_good,
                cur_good,
                f"change batch {_describe(*cur)} -> {_describe(*best)}: current "
                f"{' and '.join(bad)}; {detail}",
            )
        if best == cur or gain <= self.threshold:
            why = "already the best" if best == cur else f"within threshold {self.threshold:.1%}"
            return keep(
                f"keep batch {_describe(*cur)}: {why}; best {_describe(*best)}, {detail}",
                best_good if best != cur else cur_good,
                cur_good,
            )
        return Suggestion(
            best[0] * best[1] * best[2],
            *best,
            True,
            best_good,
            cur_good,
            f"change batch {_describe(*cur)} -> {_describe(*best)}: {detail}",
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples": [[*key, cnt, tot] for key, (cnt, tot) in sorted(self._samples.items())],
            "params": None if self.params is None else asdict(self.params),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._samples = {
            (int(m), int(k), int(n)): [int(c), float(t)] for m, k, n, c, t in state["samples"]
        }
        p = state.get("params")
        self.params = None if p is None else ThroughputParams(**p)
