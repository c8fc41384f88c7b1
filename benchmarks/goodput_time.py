"""The goodput-chosen worker count and batch against the fixed 2-worker demo: training
time to the demo's accuracy, through the real CLI, on the reduced MNIST-1D of
`benchmarks/adasum_steps.py` (the demo's CNN and LARS, 4,000 samples, global batch 512).

- fixed: `--nproc 2`, global batch 512 (the demo's layout);
- goodput: `--nproc 1:2` (the autoscaler picks the worker count from measured samples/s,
  `--autoscale-steps 10`) with `adaptive.batch_size = "goodput"` (Pollux picks the batch
  between 128 and 2048 every 10 steps). Not 1:4: a goodput batch of 128 does not split
  over 3 workers under `batch.elastic = "keep"`, and this box has 2 cores.

Target: the fixed run's final test accuracy. Time to target: the sum of each logged
step's batch / samples_per_s up to the first evaluation at or above it (training time,
no launches or evaluations); the whole command's wall time is printed too.
Results: OUT/results.json and OUT/table.md.

    nice .venv/bin/python benchmarks/goodput_time.py --out docs/goodput
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

STEPS = 60
COMMON = ["--task", "mnist1d", "--model", "cnn", "--task-opt", "num_samples=4000",
          "--steps", str(STEPS), "--eval-every", "5", "--checkpoint-every", "1000",
          "--log-every", "1", "--no-progress", "--no-tensorboard",
          "--set", "batch.global_batch_size=512", "--set", "batch.warmup_steps=6"]
CELLS = {
    "fixed 2 workers": ["--nproc", "2"],
    "goodput 1:2": ["--nproc", "1:2", "--autoscale-steps", "10",
                    "--set", "adaptive.batch_size=goodput", "--set", "adaptive.min_batch_size=128",
                    "--set", "adaptive.max_batch_size=2048", "--set", "adaptive.interval_steps=10"],
}


def _read(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = {int(r["step"]): r for r in rows if r["kind"] == "train"}
    evals = [(int(r["step"]), float(r["accuracy"])) for r in rows if r["kind"] == "eval"]
    workers = [(r["step"], r["new"]) for r in rows if r["kind"] == "autoscale"]
    batches = sorted({int(r["global_batch_size"]) for r in train.values()})
    return {"train": {s: r["global_batch_size"] / r["samples_per_s"] for s, r in train.items()
                      if r.get("samples_per_s")}, "evals": evals, "workers": workers,
            "batches": batches}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/goodput_time")
    args = p.parse_args(argv)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, extra in CELLS.items():
        out = root / "runs" / name.replace(" ", "_").replace(":", "-")
        cmd = [sys.executable, "-m", "bigbatch", "train", *COMMON, *extra, "--out", str(out),
               "--overwrite"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(name, "failed:", done.stderr.strip().splitlines()[-1:], flush=True)
            return 1
        results[name] = {**_read(out), "wall_s": time.perf_counter() - t0}
    target = results["fixed 2 workers"]["evals"][-1][1]
    for r in results.values():
        hit = next((s for s, a in r["evals"] if a >= target), None)
        r["steps_to_target"] = hit
        r["time_to_target_s"] = (sum(t for s, t in r["train"].items() if s <= hit)
                                 if hit else None)
        r["final_accuracy"] = r["evals"][-1][1]
        del r["train"]
    results["target"] = target
    (root / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results, root))
    return 0


def table(results: dict, root: Path) -> str:
    """OUT/table.md from the results (also: ``python -c "...; table(json.load(...))"``)."""
    lines = [f"target (the fixed run's final accuracy): {100 * results['target']:.2f}%", "",
             "| run | workers chosen (step: workers) | global batches | final accuracy | "
             "steps to target | training time to target | wall time |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if name == "target":
            continue
        chosen = ", ".join(f"{s}: {n}" for s, n in r["workers"]) or "2 (fixed)"
        t = r["time_to_target_s"]
        lines.append(f"| {name} | {chosen} | {', '.join(map(str, r['batches']))} | "
                     f"{100 * r['final_accuracy']:.2f}% (step {r['evals'][-1][0]}) | "
                     f"{r['steps_to_target'] or 'not reached'} | "
                     f"{f'{t:.2f} s' if t else 'not reached'} | {r['wall_s']:.1f} s |")
    text = "\n".join(lines) + "\n"
    (root / "table.md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
