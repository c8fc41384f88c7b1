"""Variants of the lr_find recipe at 64x/32x the base batch, for choosing the rule.

Each variant is one `bigbatch study` cell (MNIST-1D CNN, LARS) per seed: the untuned
recipe of issue 30 at 8192 (10 epochs) or the demo at 8192 (16 epochs), with extra
`section.key=value` overrides. Prints one line per variant: mean test accuracy over the
seeds (each seed), the LRs found and the range test's share of the run.

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

from bigbatch.study import StudyConfig, run_study  # noqa: E402

BASES = {
    "lars": dict(task="mnist1d", model="cnn", epochs=10, batches=[8192], strategies=["lars"],
                 micro_batch_size=1024, warmup_epochs=2, evals_per_epoch=1,
                 overrides={"all": ["batch.base_batch_size=256", "adaptive.noise_scale=false",
                                    "batch.base_lr=0.3125", "lars.lars_coeff=0.001"]}),
    "demo": dict(task="mnist1d", model="cnn", epochs=16, batches=[8192], strategies=["lars"],
                 micro_batch_size=1024, warmup_epochs=2, evals_per_epoch=1,
                 overrides={"all": ["adaptive.noise_scale=false"]}),
}
BASES["lars2048"] = dict(BASES["lars"], batches=[2048])
BASES["demo4096"] = dict(BASES["demo"], batches=[4096], micro_batch_size=512)

# name: (base, lr_find, extra overrides, task options)
VARIANTS = {
    "lars-scaled": ("lars", False, [], {}),
    "lars-find": ("lars", True, [], {}),
    "lars-find-s1.5": ("lars", True, ["batch.lr_find_safety=1.5"], {}),
    "lars-find-s3": ("lars", True, ["batch.lr_find_safety=3.0"], {}),
    "lars-find-s4": ("lars", True, ["batch.lr_find_safety=4.0"], {}),
    "lars-find-adapt": ("lars", True, ["lars.always_adapt=true"], {}),
    "lars-find-adapt-s1": ("lars", True, ["lars.always_adapt=true", "batch.lr_find_safety=1.0"], {}),
    "lars-find-steps15": ("lars", True, ["batch.lr_find_steps=15"], {}),
    "lars-find-range0.1": ("lars", True, ["batch.lr_find_steps=15",
                                          "batch.lr_find_range=[0.1, 100.0]"], {}),
    "lars-find-wsqrt": ("lars", True, ["batch.warmup_scaling=\"sqrt\"",
                                       "batch.warmup_batch_size=2048"], {}),
    "lars-find-w1": ("lars", True, ["batch.warmup_epochs=1"], {}),
    "lars-find-poly2": ("lars", True, ["batch.decay=\"poly\"", "batch.decay_power=2.0"], {}),
    "lars-find-ls": ("lars", True, [], {"label_smoothing": 0.1}),
    "lars-find-nesterov": ("lars", True, ["optimizer.nesterov=true"], {}),
    "demo-scaled": ("demo", False, [], {}),
    "demo-find": ("demo", True, [], {}),
    "demo-find-s1.5": ("demo", True, ["batch.lr_find_safety=1.5"], {}),
    "demo-find-s3": ("demo", True, ["batch.lr_find_safety=3.0"], {}),
    "demo-find-adapt": ("demo", True, ["lars.always_adapt=true"], {}),
    "demo-find-steps15": ("demo", True, ["batch.lr_find_steps=15"], {}),
    "demo-find-wsqrt": ("demo", True, ["batch.warmup_scaling=\"sqrt\"",
                                       "batch.warmup_batch_size=2048"], {}),
    "demo-find-w1": ("demo", True, ["batch.warmup_epochs=1"], {}),
    "demo-find-poly2": ("demo", True, ["batch.decay=\"poly\"", "batch.decay_power=2.0"], {}),
    "demo-find-ls": ("demo", True, [], {"label_smoothing": 0.1}),
    "demo-find-nesterov": ("demo", True, ["optimizer.nesterov=true"], {}),
    "demo-scaled-wsqrt": ("demo", False, ["batch.warmup_scaling=\"sqrt\"",
                                          "batch.warmup_batch_size=2048"], {}),
    "demo-scaled-poly2": ("demo", False, ["batch.decay=\"poly\"", "batch.decay_power=2.0"], {}),
    "demo-find-poly2-s1.5": ("demo", True, ["batch.decay=\"poly\"", "batch.decay_power=2.0",
                                            "batch.lr_find_safety=1.5"], {}),
    "demo-find-poly2-s3": ("demo", True, ["batch.decay=\"poly\"", "batch.decay_power=2.0",
                                          "batch.lr_find_safety=3.0"], {}),
    "demo-find-poly2-steps15": ("demo", True, ["batch.decay=\"poly\"", "batch.decay_power=2.0",
                                               "batch.lr_find_steps=15"], {}),
    "demo-find-poly3": ("demo", True, ["batch.decay=\"poly\"", "batch.decay_power=3.0"], {}),
    "lars-find-adapt-poly2": ("lars", True, ["lars.always_adapt=true", "batch.decay=\"poly\"",
                                             "batch.decay_power=2.0"], {}),
    "lars-find-adapt-s1.5": ("lars", True, ["lars.always_adapt=true",
                                            "batch.lr_find_safety=1.5"], {}),
    "lars-find-s1": ("lars", True, ["batch.lr_find_safety=1.0"], {}),
    "lars-find-nesterov-w1": ("lars", True, ["optimizer.nesterov=true", "batch.warmup_epochs=1"], {}),
    "lars-find-nesterov-steps15": ("lars", True, ["optimizer.nesterov=true",
                                                  "batch.lr_find_steps=15"], {}),
    "lars-scaled-nesterov": ("lars", False, ["optimizer.nesterov=true"], {}),
    "demo-scaled-nesterov": ("demo", False, ["optimizer.nesterov=true"], {}),
    "demo-find-nesterov-poly2": ("demo", True, ["optimizer.nesterov=true", "batch.decay=\"poly\"",
                                                "batch.decay_power=2.0"], {}),
    "demo-find-nesterov-steps15": ("demo", True, ["optimizer.nesterov=true",
                                                  "batch.lr_find_steps=15"], {}),
    "demo-find-nesterov-w1": ("demo", True, ["optimizer.nesterov=true", "batch.warmup_epochs=1"], {}),
    "lars2048-find": ("lars2048", True, [], {}),
    "lars2048-find-nesterov": ("lars2048", True, ["optimizer.nesterov=true"], {}),
    "lars2048-find-nesterov-steps15": ("lars2048", True, ["optimizer.nesterov=true",
                                                          "batch.lr_find_steps=15"], {}),
    "demo4096-scaled": ("demo4096", False, [], {}),
    "demo4096-scaled-nesterov": ("demo4096", False, ["optimizer.nesterov=true"], {}),
    "demo4096-find-nesterov-steps15": ("demo4096", True, ["optimizer.nesterov=true",
                                                          "batch.lr_find_steps=15"], {}),
}


def run_variant(out: Path, name: str, seed: int) -> dict:
    base, find, extra, options = VARIANTS[name]
    spec = dict(BASES[base])
    spec["overrides"] = {"all": [*spec["overrides"]["all"], *extra]}
    spec["task_options"] = options
    config = StudyConfig(**spec, seed=seed, threads=None, lr_find=find, progress=False,
                         out=str(out / name / f"s{seed}"))
    run_study(config)
    summary = json.loads((out / name / f"s{seed}" / "cells" / f"lars-b{spec['batches'][0]}" /
                          "summary.json").read_text())
    return summary


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
