"""Accuracy of each reduce mode against the fp32 mean at equal epochs, through the real
CLI (`bigbatch train`), MNIST-1D CNN, 16 epochs per cell.

Two families, because DGC's momentum correction replaces the optimizer's momentum and so
excludes LARS:
- LARS at global batch 4096 (the demo, 2 workers): mean (seeds 0 and 1: the seed-to-seed
  spread), fp16, bf16, PowerSGD rank 2, local SGD k=4, adaptive local SGD, and the
  parameter server (1 server + 2 workers), sync and async;
- momentum SGD at global batch 1024 (linear scaling from 0.1 at 128, 2 warm-up epochs):
  mean and DGC (sparsity warmed up over the first 2 epochs to 0.999, 0.99 or 0.9, on the
  tensors over 1000 elements; and 0.999 on every tensor).

Finished cells are kept (rerun to resume); results land in OUT/results.json.

    .venv/bin/python benchmarks/comm_accuracy.py --out runs/comm_accuracy
    .venv/bin/python benchmarks/comm_accuracy.py --epochs 4 --only lars   # a quick look
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LARS = ([], 2)  # the demo strategy
SGD = (["--set", "lars.enable=false", "--set", "batch.global_batch_size=1024",
        "--set", "batch.warmup_epochs=2"], 2)
# The CNN's tensors are all under Fleet's 16384: compress the three over 1000 elements
# (conv2, conv3, fc: 98% of the weights); the rest go whole.
DGC = ["--set", "dgc.rampup_step=78", "--set", "dgc.min_numel=1000"]
CELLS = {
    "lars mean": (LARS, []),
    "lars mean seed 1": (LARS, ["--seed", "1"]),
    "lars fp16": (LARS, ["--set", "data_parallel.reduce=fp16"]),
    "lars bf16": (LARS, ["--set", "data_parallel.reduce=bf16"]),
    "lars powersgd r2": (LARS, ["--set", "data_parallel.reduce=powersgd"]),
    "lars localsgd k4": (LARS, ["--set", "localsgd.k_steps=4"]),
    "lars adaptive localsgd": (LARS, ["--set", "adaptive_localsgd.init_k_steps=2"]),
    "lars ps sync": ((LARS[0], 3), ["--set", "parameter_server.servers=1"]),
    "lars ps async": ((LARS[0], 3), ["--set", "parameter_server.servers=1",
                                     "--set", "parameter_server.mode=async"]),
    "sgd mean": (SGD, []),
    "sgd dgc 0.999": (SGD, [*DGC, "--set",
                            "dgc.sparsity=[0.75, 0.9375, 0.984375, 0.996, 0.999]"]),
    "sgd dgc 0.99": (SGD, [*DGC, "--set", "dgc.sparsity=[0.75, 0.9375, 0.984375, 0.99]"]),
    "sgd dgc 0.9": (SGD, [*DGC, "--set", "dgc.sparsity=[0.75, 0.9]"]),
    "sgd dgc 0.999, every tensor": (SGD, [*DGC, "--set", "dgc.min_numel=0", "--set",
                                          "dgc.sparsity=[0.75, 0.9375, 0.984375, 0.996, 0.999]"]),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/comm_accuracy")
    p.add_argument("--epochs", type=float, default=16)
    p.add_argument("--only", choices=("lars", "sgd"), help="one family")
    args = p.parse_args(argv)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results_file = root / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for name, ((base, nproc), extra) in CELLS.items():
        if args.only and not name.startswith(args.only):
            continue
        key = f"{name} @ {args.epochs:g} epochs"
        if key in results:
            continue
        out = root / name.replace(" ", "_")
        cmd = [sys.executable, "-m", "bigbatch", "train", "--nproc", str(nproc), "--epochs",
               str(args.epochs), "--out", str(out), "--no-progress", "--no-tensorboard",
               *base, *extra]
        t0 = time.perf_counter()
        code = subprocess.call(cmd, stdout=subprocess.DEVNULL)
        if code != 0:
            print(f"{name}: exit {code}")
            continue
        s = json.loads((out / "summary.json").read_text())
        results[key] = {"test_accuracy": s["test_accuracy"], "test_loss": s["test_loss"],
                        "global_batch_size": s["global_batch_size"], "steps": s["steps"],
                        "seconds": time.perf_counter() - t0,
                        "parameter_server": s.get("parameter_server")}
        results_file.write_text(json.dumps(results, indent=2) + "\n")
        print(f"{name}: {100 * s['test_accuracy']:.2f}%", flush=True)
    print("\n| cell | global batch | epochs | test accuracy | wall s |\n|---|---|---|---|---|")
    for key, r in results.items():
        name, _, epochs = key.partition(" @ ")
        print(f"| {name} | {r['global_batch_size']} | {epochs.split()[0]} | "
              f"{100 * r['test_accuracy']:.2f}% | {r['seconds']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
