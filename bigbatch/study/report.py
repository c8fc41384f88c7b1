"""The study's analysis and report: results.json, report.md and PNG figures.

Everything the report says is computed from the cells' `metrics.jsonl` and
`summary.json`: steps and samples to target (`bigbatch.study.samples`), the measured
noise scale (McCandlish et al. 2018: the critical batch is about B_simple), the rows
over seeds (`bigbatch.study.seeds`), the steps the adaptive methods save
(`bigbatch.study.headline`) and a verdict per claim of the seeds
(`bigbatch.study.claims`). `write` renders it: report.md in `bigbatch.study.markdown`,
the figures in `bigbatch.study.plots`.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bigbatch.study.claims import claim_accuracy, claim_scaling, critical_batch
from bigbatch.study.headline import headline
from bigbatch.study.markdown import markdown
from bigbatch.study.plots import plot_all
from bigbatch.study.samples import batch_changes, samples_at
from bigbatch.study.schedules import split_name
from bigbatch.study.seeds import aggregate


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
    parts += _growth(strategy)
    if strategy.kfac.enable:
        k = strategy.kfac
        parts.append(f"K-FAC damping {k.damping:g}, factor decay {k.factor_decay:g}, factors every "
                     f"{k.factor_update_freq} / eigenbases every {k.inv_update_freq} steps, "
                     f"kl_clip {k.kl_clip:g}")
    return ", ".join(parts)


def _growth(strategy: Any) -> list[str]:
    """How a growing cell's batch moves, in the words of its keys (none for a fixed one)."""
    b, a = strategy.batch, strategy.adaptive
    if b.schedule == "adaptive":
        return [f"batch schedule adaptive from {b.start_batch_size or b.base_batch_size}, "
                f"noise_scale_fraction {strategy.noise_scale_fraction:g}, every "
                f"{b.schedule_interval_steps} steps"]
    if b.schedule == "seesaw":
        return [f"batch schedule seesaw from {b.start_batch_size or b.base_batch_size}, every "
                f"{b.schedule_interval_steps} steps"]
    if a.goodput:
        return [f"goodput from {a.min_batch_size} up to the cell's batch, gain threshold "
                f"{a.gain_threshold:g}, every {a.interval_steps} steps"]
    if "noise_scale_doubling" in a.policies:
        return [f"noise_scale_doubling from {b.global_batch_size} up to the cell's batch, every "
                f"{a.interval_steps} steps"]
    return []


def _cell_record(cell: Any, state: dict[str, Any], metric: str) -> dict[str, Any]:
    schedule = split_name(cell.name)[1]
    start = (cell.strategy.resolve(cell.spec.get("nproc", 1)).global_batch_size
             if schedule else None)
    rec: dict[str, Any] = {"strategy": cell.name, "global_batch_size": cell.batch,
                           "seed": cell.spec.get("seed", 0), "schedule": schedule,
                           "start_batch_size": start, "dir": str(cell.dir), **state}
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
    # Samples: exact at each evaluation from the batch changes (a fixed batch has none).
    changes = batch_changes(lines)
    first = changes[0][1] if changes else summary.get("global_batch_size") or cell.batch
    rec["batch_changes"] = [list(ch) for ch in changes]
    rec["eval_samples"] = samples_at([e[0] for e in rec["evals"]], first, changes)
    rec["samples"] = summary.get("samples") or samples_at([rec["steps"] or 0], first, changes)[0]
    rec["average_batch"] = rec["samples"] / rec["steps"] if rec.get("steps") else None
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
    below (the smallest such cell, or row over seeds); None when the grid has no such
    cell. A large-batch cell is never taken for it: every "vs baseline" would then
    compare large with large."""
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


def to_target(r: dict[str, Any], target: float, higher: bool) -> None:
    """Steps, samples and epochs to `target` of one cell, and its average batch up to it."""
    evals = [(step, v) for step, _, v in r["evals"]]
    r["steps_to_target"] = stt = steps_to_target(evals, target, higher)
    points = [(n, v) for n, (_, v) in zip(r["eval_samples"], evals, strict=True)]
    r["samples_to_target"] = ntt = steps_to_target(points, target, higher)
    per_epoch = r["samples"] / r["epochs"] if r.get("epochs") and r.get("samples") else None
    r["epochs_to_target"] = ntt / per_epoch if ntt is not None and per_epoch else None
    r["average_batch_to_target"] = ntt / stt if ntt is not None and stt else None


def collect(c: Any, task: Any, recipe: Any, cells: list[Any], status: dict[str, dict],
            command: str | None = None, skipped: list[str] | None = None) -> dict[str, Any]:
    """Every number of the report, as one JSON-able dict: `cells` one per seed, `rows` the
    cells over seeds (mean and spread), `headline` the adaptive rows' steps saved."""
    import torch

    metric, higher = task.metric, task.higher_is_better
    records = [_cell_record(cell, status.get(cell.dir.name, {}), metric) for cell in cells]
    base = _baseline(aggregate(records), recipe)
    tol = c.tolerance if c.tolerance is not None else (0.005 if metric == "accuracy" else 0.02)
    target = c.target
    if target is None and base is not None:
        target = base["final"] - 0.01 if higher else base["final"] + 0.05
    for r in records:
        if r.get("evals") is not None and target is not None:
            to_target(r, target, higher)
    rows = aggregate(records)
    base = _baseline(rows, recipe)
    fixed = [r for r in rows if r["schedule"] is None]
    b_crit, b_from = critical_batch(records, base, tol, higher)
    fits = {}
    for name in (s for s in c.strategies if split_name(s)[1] is None):
        pts = [(r["global_batch_size"], r["steps_to_target"]) for r in fixed
               if r["strategy"] == name and r.get("steps_to_target")]
        fits[name] = _fit_mccandlish(pts)
    names = [s for s in c.strategies if any(x.name == s for x in cells)]
    return {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command,
        "config": asdict(c),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "machine": platform.machine(),
                        "threads": c.threads or torch.get_num_threads()},
        "task": task.name, "model": c.model, "metric": metric, "higher_is_better": higher,
        "recipe": asdict(recipe), "seeds": c.seed_list,
        "rules": {s: _rule(s) for s in names},
        "settings": {s: _settings(next(x.strategy for x in cells if x.name == s)) for s in names},
        "skipped": list(skipped or []),
        "baseline": None if base is None else {
            k: base.get(k) for k in ("strategy", "final", "global_batch_size", "seeds",
                                     "steps_to_target", "samples_to_target")},
        "no_baseline": no_baseline_line(recipe) if base is None else None,
        "budget": budget_note(c, recipe, _default_samples(task)),
        "target": target, "tolerance": tol,
        "critical_batch": b_crit, "critical_batch_from": b_from,
        "fits": fits, "cells": records, "rows": rows,
        "headline": headline(rows, base, tol, higher),
        "claims": [claim_accuracy(fixed, base, tol, higher), claim_scaling(fixed, b_crit)],
        "total_wall_s": sum(r.get("wall_time_s") or 0.0 for r in records),
    }


def _default_samples(task: Any) -> int | None:
    """The task's default `num_samples` (None: it has no such option)."""
    import inspect

    p = inspect.signature(type(task).__init__).parameters.get("num_samples")
    return p.default if p is not None and isinstance(p.default, int) else None


def _rule(name: str) -> str:
    from bigbatch.study.rules import rule

    return rule(name)


def write(results: dict[str, Any], out: Path) -> None:
    """results.json, the PNG figures and report.md in `out`."""
    out = Path(out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    figures = plot_all(results, out)
    (out / "report.md").write_text(markdown(results, figures))


def _excluded(patterns) -> str:
    return "ndim <= 1" if patterns is None else str(list(patterns))
