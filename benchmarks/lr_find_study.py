"""The lr_find study: the base recipe's LR scaled by its rule against `[batch] lr_find = true`,
at 8x, 32x and 64x the base batch, equal epochs, 2 seeds; writes docs/lr-find-study.md.

Each (task, seed, mode) is one `bigbatch study` (`bigbatch.study.run_study`, cells in this
process, one thread) under OUT/<task>/<mode>-s<seed>/; a finished cell is kept on a rerun,
so the command can be stopped and started again. The page is written from the cells'
summary.json files only.

- MNIST-1D (CNN, 50,000 samples, 10 epochs): LARS with the untuned recipe of issue 30
  (Fleet's lars_coeff 0.001, base_lr 0.3125 at 256, linear, 2 warmup epochs, cosine) and
  momentum SGD (the task's recipe, 0.1 at 128 = 0.2 at 256, linear, 2 warmup epochs).
- charlm (the reduced Transformer of `bigbatch study --quick`: d_model 64, 1 layer,
  seq_len 32; 2 epochs): AdamW (the recipe, 2e-3 at 16, linear) and LAMB (sqrt), the
  study's warmup (0.25 epochs).

    .venv/bin/python benchmarks/lr_find_study.py                 # everything (~1 CPU-hour)
    .venv/bin/python benchmarks/lr_find_study.py --tasks mnist1d --seeds 0
    .venv/bin/python benchmarks/lr_find_study.py --report-only   # the page from what ran
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bigbatch.study import StudyConfig, run_study  # noqa: E402

COMMAND = "python benchmarks/lr_find_study.py"
MODES = ("scaled", "lr_find")
TASKS = {
    "mnist1d": {
        "title": "MNIST-1D (CNN, 40,000 training samples, 10 epochs)",
        "base": 256, "strategies": {"lars": "LARS", "sgd": "SGD"},
        "config": dict(task="mnist1d", model="cnn", epochs=10, batches=[2048, 8192, 16384],
                       strategies=["lars", "sgd"], micro_batch_size=1024, warmup_epochs=2,
                       evals_per_epoch=1,
                       overrides={"all": ["batch.base_batch_size=256", "adaptive.noise_scale=false"],
                                  "lars": ["batch.base_lr=0.3125", "lars.lars_coeff=0.001"],
                                  "sgd": ["batch.base_lr=0.2"]}),
    },
    "charlm": {
        "title": "charlm (Transformer d_model 64, 1 layer, seq_len 32; 2 epochs)",
        "base": 16, "strategies": {"lamb": "LAMB", "sgd": "AdamW"},
        "config": dict(task="charlm", task_options={"d_model": 64, "n_layer": 1, "seq_len": 32},
                       epochs=2, batches=[128, 512, 1024], strategies=["lamb", "sgd"],
                       micro_batch_size=256, evals_per_epoch=1,
                       overrides={"all": ["adaptive.noise_scale=false"]}),
    },
    "demo": {  # `bigbatch train`'s demo strategy (LARS, lars_coeff 0.01) at 64x
        "title": "The demo (MNIST-1D, LARS 0.1 at 128 with lars_coeff 0.01; 16 epochs)",
        "base": 128, "strategies": {"lars": "LARS (demo)"},
        "config": dict(task="mnist1d", model="cnn", epochs=16, batches=[8192],
                       strategies=["lars"], micro_batch_size=1024, warmup_epochs=2,
                       evals_per_epoch=1, overrides={"all": ["adaptive.noise_scale=false"]}),
    },
}


# Large-batch recipe pieces, each on its own on top of the MNIST-1D LARS cell at 8192
# (scaled LR, seed 0): (title, extra overrides of every cell, extra task options).
PIECES = {
    "warmup-sqrt": ("warmup x sqrt(batch / 2048): 4 epochs at 8192",
                    ["batch.warmup_scaling=\"sqrt\"", "batch.warmup_batch_size=2048"], {}),
    "poly2": ("polynomial decay, power 2", ["batch.decay=\"poly\"", "batch.decay_power=2.0"], {}),
    "smoothing": ("label smoothing 0.1", [], {"label_smoothing": 0.1}),
}


def piece_config(name: str) -> dict:
    _, overrides, options = PIECES[name]
    c = dict(TASKS["mnist1d"]["config"], batches=[8192], strategies=["lars"])
    c["overrides"] = {**c["overrides"], "all": [*c["overrides"]["all"], *overrides]}
    c["task_options"] = options
    return c


def study_dir(out: Path, task: str, mode: str, seed: int) -> Path:
    return out / task / f"{mode}-s{seed}"


def run(out: Path, tasks: list[str], seeds: list[int], modes: list[str],
        report_only: bool, batches: list[int] | None = None,
        strategies: list[str] | None = None) -> None:
    for name in [t for t in tasks if t in PIECES]:
        run_study(StudyConfig(**piece_config(name), seed=0, threads=1, progress=False,
                              out=str(out / "pieces" / name)), run_missing=not report_only)
    for task in [t for t in tasks if t in TASKS]:
        for seed in TASKS[task].get("seeds", seeds):
            for mode in modes:
                spec = dict(TASKS[task]["config"])
                if batches:  # a part of the grid (the same cells)
                    spec["batches"] = [b for b in spec["batches"] if b in batches]
                if strategies:
                    spec["strategies"] = [n for n in spec["strategies"] if n in strategies]
                if not spec["batches"] or not spec["strategies"]:
                    continue
                config = StudyConfig(**spec, seed=seed, threads=1,
                                     lr_find=mode == "lr_find", progress=False,
                                     out=str(study_dir(out, task, mode, seed)))
                run_study(config, run_missing=not report_only)


KEEP = ("task", "test_accuracy", "test_bpc", "test_loss", "epochs", "global_batch_size",
        "peak_lr", "seed", "wall_time_s", "samples", "lr_find")


def collect(out: Path) -> dict[str, dict]:
    """Every finished cell's summary (the keys the page reads), by its folder under `out`."""
    cells = {}
    for path in sorted(out.glob("**/cells/*/summary.json")):
        summary = json.loads(path.read_text())
        cells[path.parent.relative_to(out).as_posix()] = {k: summary.get(k) for k in KEEP}
    return cells


def _cell(results: dict, task: str, mode: str, seed: int, name: str, batch: int) -> dict | None:
    return results.get(f"{task}/{mode}-s{seed}/cells/{name}-b{batch}")


def _fmt(values: list[float], metric: str) -> str:
    if not values:
        return "-"
    f = (lambda v: f"{100 * v:.2f}%") if metric == "accuracy" else (lambda v: f"{v:.3f}")
    mean = f(statistics.fmean(values))
    return mean + (f" ({', '.join(f(v) for v in values)})" if len(values) > 1 else "")


def _lrs(values: list[float]) -> str:
    return ", ".join(f"{v:.3g}" for v in values) if values else "-"


def table(results: dict, task: str, seeds: list[int]) -> list[str]:
    spec = TASKS[task]
    seeds = spec.get("seeds", seeds)
    metric = "accuracy" if spec["config"]["task"] == "mnist1d" else "bpc"
    lines = [f"### {spec['title']}", "",
             f"| optimizer | batch (x base {spec['base']}) | scaled LR | test {metric}, scaled "
             f"| LR found | test {metric}, lr_find | range test / rest of run: time (samples) |",
             "|---|---|---|---|---|---|---|"]
    better = compared = 0
    for name, label in spec["strategies"].items():
        for batch in spec["config"]["batches"]:
            scaled = [s for seed in seeds if (s := _cell(results, task, "scaled", seed, name, batch))]
            found = [s for seed in seeds if (s := _cell(results, task, "lr_find", seed, name, batch))]
            if scaled and found:
                a, b = (statistics.fmean(c[f"test_{metric}"] for c in cells)
                        for cells in (scaled, found))
                compared += 1
                better += (b > a) if metric == "accuracy" else (b < a)
            records = [f["lr_find"] for f in found]
            lr_text = _lrs([r["peak_lr"] for r in records])
            if fallbacks := sum(r["fallback"] for r in records):
                lr_text += f" ({fallbacks} fell back to the scaled LR)"
            shares = [r["time_s"] / max(f["wall_time_s"] - r["time_s"], 1e-9)
                      for f, r in zip(found, records, strict=True)]
            samples = [r["steps"] * r["global_batch_size"] / f["samples"]
                       for f, r in zip(found, records, strict=True)]
            scaled_lr = (scaled[0]["peak_lr"] if scaled else
                         records[0]["scaled_lr"] if records else None)
            lines.append(" | ".join([
                f"| {label}", f"{batch} ({batch // spec['base']}x)",
                f"{scaled_lr:.3g}" if scaled_lr is not None else "-",
                _fmt([s[f"test_{metric}"] for s in scaled], metric), lr_text,
                _fmt([f[f"test_{metric}"] for f in found], metric),
                f"{statistics.fmean(shares):.0%} ({statistics.fmean(samples):.0%})" if shares
                else "-"]) + " |")
    if compared:
        lines += ["", f"lr_find did better than the scaled LR in {better} of the {compared} rows "
                  "measured both ways (mean over seeds)."]
    return lines


def pieces_table(results: dict) -> list[str]:
    base = _cell(results, "mnist1d", "scaled", 0, "lars", 8192)
    lines = ["### Large-batch recipe pieces (MNIST-1D, LARS at 8192, scaled LR, seed 0)", "",
             "Each piece alone on top of the LARS cell above (10 epochs); the defaults stay "
             "off unless a piece is better here.", "",
             "| recipe | test accuracy | vs the recipe |", "|---|---|---|"]
    ref = base["test_accuracy"] if base else None
    lines.append(f"| the recipe (linear, 2 warmup epochs, cosine) | "
                 f"{_fmt([ref] if ref is not None else [], 'accuracy')} | |")
    for name, (title, _, _) in PIECES.items():
        s = results.get(f"pieces/{name}/cells/lars-b8192")
        acc = s["test_accuracy"] if s else None
        delta = (f"{100 * (acc - ref):+.2f} points" if acc is not None and ref is not None
                 else "-")
        lines.append(f"| {title} | {_fmt([acc] if acc is not None else [], 'accuracy')} | "
                     f"{delta} |")
    return lines


def done_when(results: dict, seeds: list[int]) -> list[str]:
    """Issue 30's targets, read from the cells."""
    from bigbatch.tasks.mnist1d import _RECIPES

    def mean(task, mode, name, batch, seeds=seeds):
        cells = [s for seed in seeds if (s := _cell(results, task, mode, seed, name, batch))]
        return statistics.fmean(c["test_accuracy"] for c in cells) if cells else None

    def verdict(ok):
        return "-" if ok is None else "holds" if ok else "not reached"

    reference = _RECIPES["cnn"].reference
    rows = [("LARS, untuned recipe + lr_find, 2048, 10 epochs", ">= 98.5%",
             a := mean("mnist1d", "lr_find", "lars", 2048), None if a is None else a >= 0.985),
            ("LARS, untuned recipe + lr_find, 8192, 10 epochs", ">= 91%",
             a := mean("mnist1d", "lr_find", "lars", 8192), None if a is None else a >= 0.91),
            ("the demo + lr_find, 8192, 16 epochs", f">= {100 * (reference - 0.01):.2f}% "
             f"(batch 128: {100 * reference:.2f}%)", a := mean("demo", "lr_find", "lars", 8192),
             None if a is None else a >= reference - 0.01)]
    shares = []
    for task, spec in TASKS.items():
        for seed in spec.get("seeds", seeds):
            for name in spec["strategies"]:
                for batch in spec["config"]["batches"]:
                    if (f := _cell(results, task, "lr_find", seed, name, batch)) is not None:
                        r = f["lr_find"]
                        shares.append((r["time_s"] / max(f["wall_time_s"] - r["time_s"], 1e-9),
                                       f"{task} {name} {batch}"))
    lines = ["### Issue 30's targets", "", "| target | wanted | measured | |", "|---|---|---|---|"]
    for what, wanted, got, ok in rows:
        lines.append(f"| {what} | {wanted} | {_fmt([got] if got is not None else [], 'accuracy')} "
                     f"| {verdict(ok)} |")
    if shares:
        below = [w for share, w in shares if share <= 0.15]
        lines.append(f"| the range test's time over the run it precedes | <= 15% | "
                     f"{min(shares)[0]:.0%} to {max(shares)[0]:.0%} | {len(below)} of "
                     f"{len(shares)} runs |")
    return lines


def page(results: dict, seeds: list[int]) -> str:
    from bigbatch.config.sections import BatchConfig
    from bigbatch.train.lr_suggest import DIVERGE

    b = BatchConfig()
    lo, hi = b.lr_find_range
    head = [
        "# lr_find at 8x, 32x and 64x the base batch",
        "",
        "<!-- Written by `python benchmarks/lr_find_study.py` (the cells' numbers are in",
        "lr-find-study.json beside this page); do not edit by hand. -->",
        "",
        "`[batch] lr_find = true` (or `bigbatch train --lr-find`, `bigbatch study --lr-find`)",
        "runs the LR range test at the run's global batch before training: from a copy of the",
        "initial weights, on the run's own workers, the LR grows exponentially from "
        f"{lo:g}x to {hi:g}x",
        "the scaled LR over at most 15 steps (momentum SGD, LARS; 30 for AdamW, LAMB:",
        "`batch.lr_find_steps`) and stops once the loss diverges "
        f"(not finite, {DIVERGE:g}x",
        "its best, or back above where it started). The curve is smoothed by a centred moving",
        "average (no lag on a short sweep), and the run trains from its original initial weights",
        f"at the smoothed minimum's LR divided by {b.lr_find_safety:g} "
        "(`batch.lr_find_safety`); warmup and",
        "decay apply to that peak. A curve without a clear descent keeps the scaled LR, with a",
        "one-line warning. The run's overview and summary.json record the LR found, the",
        "curve (`lr_find.json` in the run directory) and the test's time; the checkpoint holds",
        "the LR, so a resume does not sweep again.",
        "",
        "Each row below trains one task at one global batch for the same epochs twice per seed:",
        "with the base recipe's LR scaled by its rule (linear for LARS, SGD and AdamW, square",
        "root for LAMB), and with `lr_find = true`; LARS with `[lars]`'s default Nesterov",
        "momentum. Values are the mean over seeds "
        f"{', '.join(map(str, seeds))},",
        "each seed in brackets; the last column is the range test's wall time over the rest of",
        "its run (mean over seeds; on a shared, busy CPU), and in brackets the samples it",
        "trained on over the run's, which the time follows on a quiet machine (the run also",
        "evaluates once an epoch). One worker per run: two workers take the same steps on the",
        "same global batch (tests/test_engine_dist.py), and the range test averages their",
        "losses. To fit a shared 2-core CPU, charlm runs the reduced Transformer of",
        "`bigbatch study --quick` for 2 epochs (the recipe: d_model 128, 2 layers, 4 epochs),",
        "so its bits per character are far from converged; MNIST-1D runs at the issue's",
        "settings (10 epochs, 50,000 samples), on one worker instead of two.",
        "",
        "Command (a rerun keeps finished cells; `--tasks`, `--seeds`, `--modes` run a part;",
        "`--from-json` rewrites this page from lr-find-study.json):",
        "",
        "<!-- not-run: the study itself (about an hour of CPU) -->",
        "```bash",
        COMMAND,
        "```",
        "",
    ]
    body: list[str] = done_when(results, seeds) + [""]
    for task in TASKS:
        body += table(results, task, seeds) + [""]
    body += pieces_table(results)
    return "\n".join(head + body) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join([*TASKS, *PIECES]),
                   help=f"of {', '.join([*TASKS, *PIECES])} (comma-separated; default: all)")
    p.add_argument("--seeds", default="0,1", help="comma-separated (default 0,1)")
    p.add_argument("--out", default="runs/lr-find-study", help="the studies' folder")
    p.add_argument("--doc", default="docs/lr-find-study.md", help="the page to write")
    p.add_argument("--modes", default=",".join(MODES), help="of scaled, lr_find (default both)")
    p.add_argument("--batches", help="comma-separated: only these batches of the grid")
    p.add_argument("--strategies", help="comma-separated: only these strategies (study names: "
                   "lars, sgd, lamb)")
    p.add_argument("--report-only", action="store_true", help="write the page from what ran")
    p.add_argument("--from-json", action="store_true", help="write the page from the results "
                   "file beside it (DOC with .json), without OUT")
    args = p.parse_args(argv)
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    doc = Path(args.doc)
    data = doc.with_suffix(".json")
    if args.from_json:
        results = json.loads(data.read_text())["cells"]
    else:
        run(out, args.tasks.split(","), seeds, args.modes.split(","), args.report_only,
            [int(b) for b in args.batches.split(",")] if args.batches else None,
            args.strategies.split(",") if args.strategies else None)
        results = collect(out)
        data.write_text(json.dumps({"command": COMMAND, "seeds": seeds, "cells": results},
                                   indent=1) + "\n")
    doc.write_text(page(results, seeds))
    print(f"wrote {doc} and {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
