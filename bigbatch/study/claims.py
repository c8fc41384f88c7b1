"""The study's verdicts on the seeds' claims, from its (seed-averaged) cells: layer-wise
optimizers keep accuracy where SGD loses it; steps to target fall about linearly with
the batch up to the critical batch (the measured noise scale, McCandlish et al. 2018).
`bigbatch.study.report` calls them; each returns a claim, its verdict and why."""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["HEALTHY", "NEAR_LINEAR", "claim_accuracy", "claim_scaling", "critical_batch",
           "loss_vs"]

NEAR_LINEAR = 0.6
"""Scaling efficiency (S1/S2)/(B2/B1) at or above which steps fall "about linearly"."""

HEALTHY = 4.0
"""A cell within HEALTHY x tolerance of the baseline trained well enough to measure its noise."""


def critical_batch(cells, base, tol, higher) -> tuple[float | None, str]:
    """Median late-training noise scale over the cells that trained well (a diverged run's
    gradients say nothing about the good trajectory), unbiased estimates first."""
    def value(c: dict[str, Any]) -> float:
        return math.inf if c.get("noise_scale_unresolved") else c["noise_scale"]

    measured = [c for c in cells if c.get("noise_scale") or c.get("noise_scale_unresolved")]
    healthy = [c for c in measured if base is not None
               and loss_vs(c["final"], base["final"], higher) <= HEALTHY * tol]
    for pool, label in ((healthy, "well-trained cells"), (measured, "all cells")):
        unbiased = [value(c) for c in pool if not c.get("noise_scale_biased")]
        kind = "unbiased"
        if not unbiased:
            unbiased, kind = [value(c) for c in pool], "biased"
        if unbiased:
            b = statistics.median(unbiased)
            return (b if math.isfinite(b) else None), f"{label}, {kind} estimates ({len(unbiased)})"
    return None, "none"


def loss_vs(value: float, base: float, higher: bool) -> float:
    """How much worse `value` is than `base` (positive: worse)."""
    return base - value if higher else value - base


def claim_accuracy(cells, base, tol, higher) -> dict[str, Any]:
    by = {(c["strategy"], c["global_batch_size"]): c for c in cells if c.get("final") is not None}
    layerwise = [s for s in ("lars", "lamb") if any(k[0] == s for k in by)]
    claim = {"claim": "At a batch where SGD with linear scaling loses accuracy, LARS/LAMB stay "
             f"within {tol:g} of the small-batch baseline in the same epochs", "rows": []}
    if base is None:
        return {**claim, "verdict": "untested",
                "why": "no small-batch baseline (an sgd cell at the recipe's batch or below)"}
    if not layerwise or not any(k[0] == "sgd" for k in by):
        return {**claim, "verdict": "untested", "why": "needs sgd and lars or lamb cells"}
    held, failed = [], []
    for (name, batch), c in sorted(by.items(), key=lambda kv: kv[0][1]):
        if name != "sgd" or batch <= base["global_batch_size"]:
            continue
        sgd_loss = loss_vs(c["final"], base["final"], higher)
        for lw in layerwise:
            other = by.get((lw, batch))
            if other is None:
                continue
            lw_loss = loss_vs(other["final"], base["final"], higher)
            row = {"global_batch_size": batch, "layerwise": lw, "sgd_loss": sgd_loss,
                   "layerwise_loss": lw_loss, "sgd_lost": sgd_loss > tol,
                   "layerwise_kept": lw_loss <= tol}
            claim["rows"].append(row)
            if row["sgd_lost"]:
                (held if row["layerwise_kept"] else failed).append(f"{lw}@{batch}")
    if not held and not failed:
        return {**claim, "verdict": "untested",
                "why": f"SGD with linear scaling stayed within {tol:g} at every batch of the grid"}
    verdict = "held" if not failed else ("did not hold" if not held else "partly held")
    why = (f"SGD lost more than {tol:g} at {len(held) + len(failed)} cell(s); the layer-wise "
           f"optimizer kept accuracy at {', '.join(held) or 'none'}"
           + (f" and lost it at {', '.join(failed)}" if failed else ""))
    return {**claim, "verdict": verdict, "why": why}


def claim_scaling(cells, b_crit) -> dict[str, Any]:
    """Scaling efficiency (S1/S2)/(B2/B1) of each pair of neighbouring batches of a strategy;
    a pair is below the critical batch when its geometric mean is. A batch that never reached
    the target gives an upper bound (its budget), which decides only when below NEAR_LINEAR."""
    claim = {"claim": "Steps to target fall about linearly with the batch up to the critical "
             "batch (measured noise scale) and flatten beyond it", "pairs": []}
    if b_crit is None:
        return {**claim, "verdict": "untested", "why": "no noise-scale measurement"}
    sides: dict[str, list[float]] = {"below": [], "above": []}
    open_pairs = 0
    for name in dict.fromkeys(c["strategy"] for c in cells):
        row = sorted((c for c in cells if c["strategy"] == name and c.get("steps")),
                     key=lambda c: c["global_batch_size"])
        for c1, c2 in zip(row, row[1:], strict=False):
            s1, s2 = c1.get("steps_to_target"), c2.get("steps_to_target")
            if s1 is None:
                continue
            b1, b2 = c1["global_batch_size"], c2["global_batch_size"]
            bound = s2 is None
            eff = (s1 / (s2 if s2 is not None else c2["steps"])) / (b2 / b1)
            region = "below" if math.sqrt(b1 * b2) <= b_crit else "above"
            claim["pairs"].append({"strategy": name, "from": b1, "to": b2, "efficiency": eff,
                                   "upper_bound": bound, "region": region})
            if bound and eff >= NEAR_LINEAR:
                open_pairs += 1  # "at most 0.8" says neither linear nor flat
            else:
                sides[region].append(eff)
    parts, verdicts = [], []
    below, above = sides["below"], sides["above"]
    if below:
        m = statistics.median(below)
        verdicts.append(m >= NEAR_LINEAR)
        parts.append(f"below B_crit={b_crit:.0f} the median scaling efficiency is {m:.2f} over "
                     f"{len(below)} pair(s) ({'about linear' if m >= NEAR_LINEAR else 'not linear'}"
                     f"; threshold {NEAR_LINEAR})")
    else:
        parts.append(f"no decisive batch pair below B_crit={b_crit:.0f}")
    if above:
        m = statistics.median(above)
        flat = m < NEAR_LINEAR
        verdicts.append(flat)
        parts.append(f"above it {m:.2f} over {len(above)} pair(s) "
                     f"({'flattening' if flat else 'still about linear'})")
    else:
        parts.append("no decisive batch pair above it")
    if open_pairs:
        parts.append(f"{open_pairs} pair(s) undecided (target not reached, bound >= {NEAR_LINEAR})")
    if not verdicts:
        verdict = "untested"
    elif len(verdicts) == 2:
        verdict = "held" if all(verdicts) else "did not hold" if not any(verdicts) else "partly held"
    else:
        side = "below B_crit only" if below else "above B_crit only"
        verdict = f"{'held' if verdicts[0] else 'did not hold'} ({side})"
    return {**claim, "verdict": verdict, "why": "; ".join(parts)}
