"""`bigbatch train` throughput: 1 worker vs 2 workers at the same global batch, in one run.

Runs the real command (`python -m bigbatch train`, and `--nproc 2` through
torchrun) on the built-in task for a fixed number of optimizer steps and reads
each run's summary.json: median samples/s over the logged intervals, and the
share of step time spent outside forward/backward/optimizer (data fetching,
logging, checkpointing; target <= 5%). One worker uses all intra-op threads
(`--threads1`, default: torch's default); the two workers get one thread each,
as torchrun sets. The runs alternate `--rounds` times so machine noise hits
both alike.

    .venv/bin/python benchmarks/train_throughput.py
    .venv/bin/python benchmarks/train_throughput.py --global-batch 1024 --steps 40 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(nproc: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bigbatch", "train", "--out", str(out), "--no-progress",
           "--no-tensorboard", "--task", args.task, "--steps", str(args.steps),
           "--set", f"batch.global_batch_size={args.global_batch}",
           "--set", "batch.warmup_epochs=0", "--log-every", str(args.log_every),
           "--checkpoint-every", str(args.checkpoint_every)]
    if args.model:
        cmd += ["--model", args.model]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    env = dict(os.environ)
    if nproc == 1 and args.threads1:
        env["OMP_NUM_THREADS"] = str(args.threads1)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="mnist1d")
    p.add_argument("--model", default=None)
    p.add_argument("--global-batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads1", type=int, default=None,
                   help="intra-op threads of the 1-worker run (default: torch's default)")
    args = p.parse_args()

    results: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for nproc in (1, 2):
                results[nproc].append(run(nproc, args, Path(tmp) / f"w{nproc}-{r}"))

    print(f"task {args.task}, global batch {args.global_batch}, {args.steps} steps, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")
    print(f"{'workers':>8} {'samples/s':>12} {'overhead':>9} {'compute s':>10} "
          f"{'steps s':>8} {'ckpt s':>7}")
    sps = {}
    for nproc, runs in results.items():
        sps[nproc] = statistics.median(s["samples_per_s"] for s in runs)
        over = statistics.median(s["overhead_share"] for s in runs)
        t = runs[-1]["time_s"]
        print(f"{nproc:>8} {sps[nproc]:>12,.0f} {100 * over:>8.1f}% {t['compute']:>10.2f} "
              f"{t['steps']:>8.2f} {t['checkpoint']:>7.2f}")
    print(f"2 workers / 1 worker samples/s: {sps[2] / sps[1]:.2f}x")


if __name__ == "__main__":
    main()
