"""Does the noise scale depend on how the batch is split? One process against N ranks.

The same recipe and the same global batch run twice through `bigbatch train`: on one
process, where the small batch is the first of two merged micro-steps, and on N gloo
ranks, where it is each rank's share. Both estimate the same ``B_simple`` from the same
kind of pair (a batch of G/2 against G), so they must agree within the uncertainty each
reports (``gns_stderr``, the tracker's delta-method error over its recent estimates).

Before coordinates with no Adam second moment were dropped from the preconditioned
norm, charlm with LAMB gave 1142.8 on 2 ranks and 19.25 on one process.

    .venv/bin/python benchmarks/gns_agreement.py                      # charlm, LAMB
    .venv/bin/python benchmarks/gns_agreement.py --recipe adamw
    .venv/bin/python benchmarks/gns_agreement.py --task mnist1d --steps 150

Prints, for each layout, the noise scale averaged over the last quarter of the run's
logged estimates with its reported standard error, and whether the two agree (their
difference within twice the combined error).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPES = {  # --set overrides over the task's demo strategy
    "lamb": [],
    "adamw": ["lamb.enable=false", "optimizer.weight_decay=0.01", "batch.base_lr=0.002"],
    "lars": [],
}


def run(task: str, nproc: int, batch: int, steps: int, extra: list[str], out: Path,
        seed: int) -> list[dict]:
    argv = [sys.executable, "-m", "bigbatch", "train", "--task", task, "--nproc", str(nproc),
            "--steps", str(steps), "--out", str(out), "--overwrite", "--no-progress",
            "--no-tensorboard", "--log-every", "1", "--seed", str(seed),
            "--set", "batch.schedule=fixed", "--set", "batch.start_batch_size=none",
            "--set", f"batch.global_batch_size={batch}",
            "--set", f"batch.micro_batch_size={batch // 2}",
            "--set", "adaptive.noise_scale=true"]
    if nproc == 1:
        argv += ["--set", "gradient_merge.k_steps=2", "--set", "gradient_merge.avg=true"]
    for item in extra:
        argv += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train" and "gns" in x]


def summary(rows: list[dict]) -> tuple[float, float]:
    """The last logged estimate and its standard error (the tracker's own EMA)."""
    last = rows[-1]
    return float(last["gns"]), float(last.get("gns_stderr", math.nan))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="charlm")
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="charlm: lamb (the demo) or adamw; mnist1d: lars (the demo)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: demo's)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    recipe = a.recipe or ("lamb" if a.task == "charlm" else "lars")
    batch = a.batch or (128 if a.task == "charlm" else 4096)
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, a.nproc):
            rows = run(a.task, n, batch, a.steps, RECIPES[recipe], Path(tmp) / f"n{n}", a.seed)
            got[n] = summary(rows)
            print(f"{a.task}/{recipe}, global batch {batch}, {n} process(es): B_simple = "
                  f"{got[n][0]:.4g} +- {got[n][1]:.3g} (step {rows[-1]['step']})", flush=True)
    (b1, e1), (bn, en) = got[1], got[a.nproc]
    tol = 2 * math.hypot(e1, en)
    verdict = "agree" if abs(b1 - bn) <= tol else "DISAGREE"
    print(f"difference {abs(b1 - bn):.3g}, twice the combined error {tol:.3g}: {verdict}")


if __name__ == "__main__":
    main()
