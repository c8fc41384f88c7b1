"""Adasum against the mean at 2 and 4 workers: optimizer steps to the averaging run's
quality, through the real CLI (`bigbatch train --nproc N`), on a reduced MNIST-1D (the
demo's CNN, 4,000 samples, global batch 512) so that every cell fits this 2-core box.

Cells: LARS (Adasum on gradients, Horovod's rule for momentum SGD) and LAMB (Adasum on
the optimizer's weight changes, `data_parallel.adasum_on = "auto"`), each with
`reduce = "mean"` and `"adasum"` (`adasum_lr = "worker"`, Horovod's rule) at 2 and 4
workers. The target is the test accuracy the 2-worker mean run of that optimizer ends
with (its last evaluation); steps to target are the first evaluation at or above it.
`--seeds 0 1` runs a second seed for the spread. Results: OUT/results.json (finished
cells are kept; rerun to resume).

    nice .venv/bin/python benchmarks/adasum_steps.py --out docs/adasum
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

STEPS, EVAL = 60, 5
COMMON = ["--task", "mnist1d", "--model", "cnn", "--task-opt", "num_samples=4000",
          "--steps", str(STEPS), "--eval-every", str(EVAL), "--checkpoint-every", "1000",
          "--no-progress", "--no-tensorboard", "--set", "batch.global_batch_size=512",
          "--set", "batch.warmup_steps=6"]
OPTIMIZERS = {
    "lars": [],  # the demo's strategy
    "lamb": ["--set", "lars.enable=false", "--set", "optimizer.type=adamw",
             "--set", "batch.base_lr=0.01", "--set", "batch.scaling=sqrt",
             "--set", "lamb.lamb_weight_decay=0.01"],
}
REDUCES = {"mean": [], "adasum": ["--set", "data_parallel.reduce=adasum"]}


def _evals(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), float(r["accuracy"])) for r in rows if r["kind"] == "eval"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/adasum_steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = p.parse_args(argv)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for seed in args.seeds:
        for opt, opt_args in OPTIMIZERS.items():
            for n in (2, 4):
                for reduce, red_args in REDUCES.items():
                    name = f"{opt} {reduce} {n} workers seed {seed}"
                    if name in results:
                        continue
                    out = root / "runs" / name.replace(" ", "_")
                    cmd = [sys.executable, "-m", "bigbatch", "train", *COMMON, *opt_args,
                           *red_args, "--nproc", str(n), "--seed", str(seed), "--out", str(out),
                           "--overwrite"]
                    t0 = time.perf_counter()
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode:
                        print(name, "failed:", done.stderr.strip().splitlines()[-1:], flush=True)
                        return 1
                    results[name] = {"evals": _evals(out), "wall_s": time.perf_counter() - t0}
                    path.write_text(json.dumps(results, indent=1) + "\n")
                    print(name, results[name]["evals"][-1], flush=True)
    _table(results, args.seeds, root)
    return 0


def _table(results: dict, seeds: list[int], root: Path) -> None:
    lines = ["| optimizer | workers | reduce | " + " | ".join(
        f"seed {s}: final acc, steps to target" for s in seeds) + " |",
        "|---|---|---|" + "---|" * len(seeds)]
    for opt in OPTIMIZERS:
        targets = {s: results[f"{opt} mean 2 workers seed {s}"]["evals"][-1][1] for s in seeds}
        for n in (2, 4):
            for reduce in REDUCES:
                cells = []
                for s in seeds:
                    ev = results[f"{opt} {reduce} {n} workers seed {s}"]["evals"]
                    hit = next((st for st, a in ev if a >= targets[s]), None)
                    cells.append(f"{100 * ev[-1][1]:.2f}%, "
                                 + (f"{hit}" if hit else f"not reached (> {STEPS})"))
                lines.append(f"| {opt} | {n} | {reduce} | " + " | ".join(cells) + " |")
    text = ("targets (the 2-worker mean run's final accuracy): " + "; ".join(
        f"{opt} seed {s} {100 * results[f'{opt} mean 2 workers seed {s}']['evals'][-1][1]:.2f}%"
        for opt in OPTIMIZERS for s in seeds) + "\n\n" + "\n".join(lines) + "\n")
    (root / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
