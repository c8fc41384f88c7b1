"""The study's analysis and report: results.json, report.md and PNG figures.

Everything the report says is computed from the cells' `metrics.jsonl` and
`summary.json`: steps to target, the measured noise scale (McCandlish et al.
2018: the critical batch is about B_simple), and a verdict per claim of the seeds.
`write` renders it: report.md in `bigbatch.study.markdown`, the figures in
`bigbatch.study.plots`.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bigbatch.study.markdown import markdown
from bigbatch.study.plots import plot_all

NEAR_LINEAR = 0.6
"""Scaling efficiency (S1/S2)/(B2/B1) at or above which steps fall "about linearly"."""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    lines = []
    try:
        text = path.read_text()
    except OSError:
        return lines
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash
    return lines


def steps_to_target(evals: list[tuple[float, float]], target: float,
                    higher_is_better: bool = True) -> float | None:
    """First step at which the metric reaches `target`, linearly interpolated between the
    bracketing evaluations (the eval step itself when there is none before); None if never."""
    def reached(v: float | None) -> bool:
        return v is not None and (v >= target if higher_is_better else v <= target)

    prev: tuple[float, float] | None = None
    for step, value in evals:
        if reached(value):
            if prev is None or prev[1] is None or value == prev[1]:
                return float(step)
            frac = (target - prev[1]) / (value - prev[1])
            return prev[0] + min(max(frac, 0.0), 1.0) * (step - prev[0])
        prev = (step, value)
    return None


def _fit_mccandlish(points: list[tuple[int, float]]) -> dict[str, float] | None:
    """Least squares of S = S_min (1 + B_noise / B) on (B, S); None if ill-posed."""
    if len(points) < 3:
        return None
    xs, ys = [1.0 / b for b, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    s_min = my - slope * mx
    if s_min <= 0 or slope <= 0:
        return None
    return {"s_min": s_min, "b_noise": slope / s_min}


def _sig(x: float | None, digits: int = 5) -> float | None:
    """`x` to `digits` significant digits (keeps results.json small)."""
    return None if x is None else float(f"{x:.{digits}g}")


def _settings(strategy: Any) -> str:
    """The keys of a cell's Strategy that its rule sets, in one line."""
    b, o = strategy.batch, strategy.optimizer
    parts = [f"{strategy.optimizer_name()}", f"base LR {b.base_lr:g} at {b.base_batch_size}",
             f"scaling {b.scaling}", f"warmup {b.warmup_epochs:g} epochs", f"{b.decay} decay"]
    if o.type == "momentum" and o.momentum > 0:
        parts.insert(1, f"{'Nesterov' if strategy.nesterov else 'heavy-ball'} momentum "
                        f"{o.momentum:g}")
    if strategy.lars.enable:
        la = strategy.lars
        parts.append(f"lars_coeff {la.lars_coeff:g}, lars_weight_decay {la.lars_weight_decay:g}, "
                     f"excluded {_excluded(la.exclude_from_weight_decay)}")
    elif strategy.lamb.enable:
        lb = strategy.lamb
        parts.append(f"lamb_weight_decay {lb.lamb_weight_decay:g}, "
                     f"excluded {_excluded(lb.exclude_from_weight_decay)}")
    else:
        parts.append(f"weight decay {o.weight_decay:g}")
    if strategy.adaptive.lr != "none":
        parts.append(f"adaptive lr {strategy.adaptive.lr}")
    if strategy.kfac.enable:
        k = strategy.kfac
        parts.append(f"K-FAC damping {k.damping:g}, factor decay {k.factor_decay:g}, factors every "
                     f"{k.factor_update_freq} / eigenbases every {k.inv_update_freq} steps, "
                     f"kl_clip {k.kl_clip:g}")
    return ", ".join(parts)


def _cell_record(cell: Any, state: dict[str, Any], metric: str) -> dict[str, Any]:
    rec: dict[str, Any] = {"strategy": cell.name, "global_batch_size": cell.batch,
                           "dir": str(cell.dir), **state}
    summary = None
    if (cell.dir / "summary.json").is_file():
        summary = json.loads((cell.dir / "summary.json").read_text())
    if summary is None:
        rec["status"] = "failed" if state.get("status") == "failed" else "missing"
        return rec
    lines = read_metrics(cell.dir / "metrics.jsonl")
    rec.update({k: summary.get(k) for k in ("optimizer", "micro_batch_size", "k_steps",
                                            "peak_lr", "steps", "epochs", "wall_time_s")})
    rec["test"] = {k[5:]: v for k, v in summary.items() if k.startswith("test_")}
    rec["final"] = summary.get(f"test_{metric}")
    rec["evals"] = [[d["step"], d["epoch"], d.get(metric)] for d in lines if d.get("kind") == "eval"]
    rec["noise_scale_series"] = [[d["step"], _sig(d["epoch"]), _sig(d["gns"]),
                                  bool(d.get("gns_biased")), _sig(d.get("gns_trace")),
                                  _sig(d.get("gns_sq_norm"))]
                                 for d in lines if d.get("kind") == "train" and d.get("gns")]
    rec["adascale_gain"] = [[d["step"], d["adascale_gain"]] for d in lines
                            if d.get("kind") == "train" and d.get("adascale_gain") is not None]
    # Ratio of the means of the two unbiased estimates over the second half (McCandlish et al.).
    late = [(d["gns_trace"], d["gns_sq_norm"]) for d in lines
            if d.get("kind") == "train" and d.get("gns_trace") is not None
            and d.get("gns_sq_norm") and d["epoch"] >= 0.5 * (rec["epochs"] or 0)]
    mean_g = statistics.fmean(g for _, g in late) if late else 0.0
    rec["noise_scale"] = (max(statistics.fmean(t for t, _ in late), 0.0) / mean_g
                          if mean_g > 0 else None)
    # |G|^2 averaging <= 0: no detectable signal, a noise scale beyond what the batches resolve.
    rec["noise_scale_unresolved"] = bool(late) and mean_g <= 0
    rec["noise_scale_biased"] = any(row[3] for row in rec["noise_scale_series"])
    return rec


def _baseline(cells: list[dict[str, Any]], recipe: Any) -> dict[str, Any] | None:
    """The small-batch baseline: the recipe's optimizer (`sgd`) at the recipe's batch or
    below (the smallest such cell); None when the grid has no such cell. A large-batch cell
    is never taken for it: every "vs baseline" would then compare large with large."""
    small = [c for c in cells if c.get("final") is not None and c["strategy"] == "sgd"
             and c["global_batch_size"] <= recipe.base_batch_size]
    return min(small, key=lambda c: c["global_batch_size"]) if small else None


def no_baseline_line(recipe: Any) -> str:
    """What the report says in place of the baseline when the grid has none."""
    b = recipe.base_batch_size
    return (f"No small-batch baseline: the grid has no sgd cell at the recipe's batch {b} or "
            f"below, so nothing is compared with one (add it, e.g. --strategies sgd,... "
            f"--batches {b},...).")


def budget_note(c: Any, recipe: Any, default_samples: int | None) -> str | None:
    """"small budget: ..." when the cells train less than the recipe does (fewer epochs, or
    fewer samples than the task's default), else None: a verdict then says why it may
    differ from a full study's."""
    parts = []
    if c.epochs < recipe.epochs:
        parts.append(f"{c.epochs:g} of the recipe's {recipe.epochs:g} epochs")
    n = c.task_options.get("num_samples")
    if n is not None and default_samples is not None and n < default_samples:
        parts.append(f"{n:,} of {default_samples:,} samples")
    return "small budget: " + ", ".join(parts) if parts else None


HEALTHY = 4.0
"""A cell within HEALTHY x tolerance of the baseline trained well enough to measure its noise."""


def _critical_batch(cells, base, tol, higher) -> tuple[float | None, str]:
    """Median late-training noise scale over the cells that trained well (a diverged run's
    gradients say nothing about the good trajectory), unbiased estimates first."""
    def value(c: dict[str, Any]) -> float:
        return math.inf if c.get("noise_scale_unresolved") else c["noise_scale"]

    measured = [c for c in cells if c.get("noise_scale") or c.get("noise_scale_unresolved")]
    healthy = [c for c in measured if base is not None
               and _loss_vs(c["final"], base["final"], higher) <= HEALTHY * tol]
    for pool, label in ((healthy, "well-trained cells"), (measured, "all cells")):
        unbiased = [value(c) for c in pool if not c.get("noise_scale_biased")]
        kind = "unbiased"
        if not unbiased:
            unbiased, kind = [value(c) for c in pool], "biased"
        if unbiased:
            b = statistics.median(unbiased)
            return (b if math.isfinite(b) else None), f"{label}, {kind} estimates ({len(unbiased)})"
    return None, "none"


def _loss_vs(value: float, base: float, higher: bool) -> float:
    """How much worse `value` is than `base` (positive: worse)."""
    return base - value if higher else value - base


def _claim_accuracy(cells, base, tol, higher) -> dict[str, Any]:
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
        sgd_loss = _loss_vs(c["final"], base["final"], higher)
        for lw in layerwise:
            other = by.get((lw, batch))
            if other is None:
                continue
            lw_loss = _loss_vs(other["final"], base["final"], higher)
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


def _claim_scaling(cells, b_crit) -> dict[str, Any]:
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


def collect(c: Any, task: Any, recipe: Any, cells: list[Any], status: dict[str, dict],
            command: str | None = None) -> dict[str, Any]:
    """Every number of the report, as one JSON-able dict."""
    import torch

    metric, higher = task.metric, task.higher_is_better
    records = [_cell_record(cell, status.get(cell.dir.name, {}), metric) for cell in cells]
    base = _baseline(records, recipe)
    tol = c.tolerance if c.tolerance is not None else (0.005 if metric == "accuracy" else 0.02)
    target = c.target
    if target is None and base is not None:
        target = base["final"] - 0.01 if higher else base["final"] + 0.05
    for r in records:
        if r.get("evals") is not None and target is not None:
            evals = [(s, v) for s, _, v in r["evals"]]
            r["steps_to_target"] = steps_to_target(evals, target, higher)
            spe = r["steps"] / r["epochs"] if r.get("epochs") else None
            r["epochs_to_target"] = (r["steps_to_target"] / spe
                                     if r["steps_to_target"] is not None and spe else None)
    b_crit, b_from = _critical_batch(records, base, tol, higher)
    fits = {}
    for name in c.strategies:
        pts = [(r["global_batch_size"], r["steps_to_target"]) for r in records
               if r["strategy"] == name and r.get("steps_to_target")]
        fits[name] = _fit_mccandlish(pts)
    return {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command,
        "config": asdict(c),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "machine": platform.machine(),
                        "threads": c.threads or torch.get_num_threads()},
        "task": task.name, "model": c.model, "metric": metric, "higher_is_better": higher,
        "recipe": asdict(recipe),
        "rules": {s: _rule(s) for s in c.strategies},
        "settings": {s: _settings(next(x.strategy for x in cells if x.name == s))
                     for s in c.strategies},
        "baseline": None if base is None else {"strategy": base["strategy"], "final": base["final"],
                                               "global_batch_size": base["global_batch_size"]},
        "no_baseline": no_baseline_line(recipe) if base is None else None,
        "budget": budget_note(c, recipe, _default_samples(task)),
        "target": target, "tolerance": tol,
        "critical_batch": b_crit, "critical_batch_from": b_from,
        "fits": fits, "cells": records,
        "claims": [_claim_accuracy(records, base, tol, higher), _claim_scaling(records, b_crit)],
        "total_wall_s": sum(r.get("wall_time_s") or 0.0 for r in records),
    }


def _default_samples(task: Any) -> int | None:
    """The task's default `num_samples` (None: it has no such option)."""
    import inspect

    p = inspect.signature(type(task).__init__).parameters.get("num_samples")
    return p.default if p is not None and isinstance(p.default, int) else None


def _rule(name: str) -> str:
    from bigbatch.study.rules import RULES

    return RULES[name]


def write(results: dict[str, Any], out: Path) -> None:
    """results.json, the PNG figures and report.md in `out`."""
    out = Path(out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    figures = plot_all(results, out)
    (out / "report.md").write_text(markdown(results, figures))


def _excluded(patterns) -> str:
    return "ndim <= 1" if patterns is None else str(list(patterns))
