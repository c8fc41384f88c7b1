"""Variants of the lr_find recipe at 32x/64x the base batch, for choosing the defaults.

Each variant is one `bigbatch study` cell (MNIST-1D CNN, LARS) per seed, named
``BASE-MODE[-PIECE...]``: BASE one of `BASES` (the untuned recipe of issue 30 or the demo,
as `benchmarks/lr_find_study.py` defines them, at one batch), MODE ``scaled`` or ``find``
(`lr_find = true`), each PIECE an entry of `PIECES` or ``sN`` (`lr_find_safety = N`). Every
cell keeps the defaults the variants were measured against (heavy-ball LARS, 30-step
sweeps: `THEN`), so a name means what benchmarks/NOTES-lr-find.md recorded for it.
Prints one line per variant: mean test accuracy over the seeds (each seed), the LRs found
and the range test's share of the run.

    python benchmarks/lr_find_variants.py --out /tmp/variants [--seeds 0 1] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lr_find_study import PIECES as RECIPE_PIECES  # noqa: E402
from lr_find_study import TASKS  # noqa: E402

from bigbatch.study import StudyConfig, run_study  # noqa: E402

# name: (task of lr_find_study, global batch, micro batch)
BASES = {"lars": ("mnist1d", 8192, 1024), "lars2048": ("mnist1d", 2048, 1024),
         "demo": ("demo", 8192, 1024), "demo4096": ("demo", 4096, 512)}
THEN = ["optimizer.nesterov=false", "batch.lr_find_steps=30"]
# name: (overrides, task options)
PIECES = {
    "nesterov": (["optimizer.nesterov=true"], {}),
    "steps15": (["batch.lr_find_steps=15"], {}),
    "range0.1": (["batch.lr_find_steps=15", "batch.lr_find_range=[0.1, 100.0]"], {}),
    "adapt": (["lars.always_adapt=true"], {}),
    "w1": (["batch.warmup_epochs=1"], {}),
    "poly3": (["batch.decay=\"poly\"", "batch.decay_power=3.0"], {}),
    "wsqrt": RECIPE_PIECES["warmup-sqrt"][1:],
    "poly2": RECIPE_PIECES["poly2"][1:],
    "ls": RECIPE_PIECES["smoothing"][1:],
}
VARIANTS = [
    "lars-scaled", "lars-find", "lars-find-s1.5", "lars-find-s3", "lars-find-s4",
    "lars-find-adapt", "lars-find-adapt-s1", "lars-find-steps15", "lars-find-range0.1",
    "lars-find-wsqrt", "lars-find-w1", "lars-find-poly2", "lars-find-ls", "lars-find-nesterov",
    "demo-scaled", "demo-find", "demo-find-s1.5", "demo-find-s3", "demo-find-adapt",
    "demo-find-steps15", "demo-find-wsqrt", "demo-find-w1", "demo-find-poly2", "demo-find-ls",
    "demo-find-nesterov", "demo-scaled-wsqrt", "demo-scaled-poly2", "demo-find-poly2-s1.5",
    "demo-find-poly2-s3", "demo-find-poly2-steps15", "demo-find-poly3", "lars-find-adapt-poly2",
    "lars-find-adapt-s1.5", "lars-find-s1", "lars-find-nesterov-w1", "lars-find-nesterov-steps15",
    "lars-scaled-nesterov", "demo-scaled-nesterov", "demo-find-nesterov-poly2",
    "demo-find-nesterov-steps15", "demo-find-nesterov-w1", "lars2048-find",
    "lars2048-find-nesterov", "lars2048-find-nesterov-steps15", "demo4096-scaled",
    "demo4096-scaled-nesterov", "demo4096-find-nesterov-steps15",
]


def _piece(name: str) -> tuple[list[str], dict]:
    if name in PIECES:
        return PIECES[name]
    if name.startswith("s"):
        return [f"batch.lr_find_safety={float(name[1:])}"], {}
    raise SystemExit(f"lr_find_variants: unknown piece {name!r} (of {', '.join(PIECES)}, sN)")


def variant_config(name: str, seed: int, out: Path) -> StudyConfig:
    """The study of variant `name` for `seed` (one cell) under `out`."""
    base, mode, *pieces = name.split("-")
    task, batch, micro = BASES[base]
    spec = dict(TASKS[task]["config"], batches=[batch], strategies=["lars"],
                micro_batch_size=micro)
    overrides, options = [*THEN], {}
    for piece in pieces:
        more, opts = _piece(piece)
        overrides, options = [*overrides, *more], {**options, **opts}
    spec["overrides"] = {**spec["overrides"], "all": [*spec["overrides"]["all"], *overrides]}
    return StudyConfig(**spec, task_options=options, seed=seed, threads=None,
                       lr_find=mode == "find", progress=False, out=str(out / name / f"s{seed}"))


def run_variant(out: Path, name: str, seed: int) -> dict:
    config = variant_config(name, seed, out)
    run_study(config)
    return json.loads((Path(config.out) / "cells" / f"lars-b{config.batches[0]}" /
                       "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/lr_find_variants")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--only", nargs="+", default=None)
    a = p.parse_args()
    out = Path(a.out)
    lines = []
    for name in a.only or list(VARIANTS):
        t0 = time.perf_counter()
        runs = [run_variant(out, name, s) for s in a.seeds]
        accs = [r["test_accuracy"] for r in runs]
        found = [r.get("lr_find") or {} for r in runs]
        lrs = ", ".join(f"{r['peak_lr']:.3g}" for r in runs)
        share = [f["time_s"] / max(r["wall_time_s"] - f["time_s"], 1e-9)
                 for f, r in zip(found, runs, strict=True) if f]
        line = (f"{name:24s} {100 * statistics.fmean(accs):6.2f}% "
                f"({', '.join(f'{100 * x:.2f}' for x in accs)})  peak {lrs}")
        if share:
            line += f"  test/run {statistics.fmean(share):.0%}"
        line += f"  [{time.perf_counter() - t0:.0f} s]"
        print(line, flush=True)
        lines.append(line)
        (out / "variants.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
