"""The parameter server against data parallelism, through the main job (MNIST-1D CNN).

1. sync, 1 server + 2 workers, against DDP on 2 workers: the final weights (and
   BatchNorm buffers) compared bit for bit, and each job's samples/s.
2. async, 1 server + 2 workers: the staleness histogram of the applied gradients.
3. one worker slowed by `--delay` seconds per step: sync waits for it at every step,
   async keeps applying the other worker's gradients (the slow one's arrive stale and
   are dropped beyond max_staleness). Samples/s are those of applied gradients over the
   job's steps, measured in the same run.

    .venv/bin/python benchmarks/parameter_server.py
    .venv/bin/python benchmarks/parameter_server.py --steps 60 --delay 0.2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _gloo import run_on_workers  # noqa: E402

import bigbatch.train.trainer as trainer  # noqa: E402
from bigbatch.config.strategy import Strategy  # noqa: E402
from bigbatch.parallel.world import World  # noqa: E402
from bigbatch.tasks import get_task  # noqa: E402
from bigbatch.train.ps_job import train_parameter_server  # noqa: E402
from bigbatch.train.trainer import TrainConfig  # noqa: E402

STRATEGY = """
[batch]
global_batch_size = 128
base_batch_size = 128
base_lr = 0.1
warmup_steps = 5
decay = "cosine"
[optimizer]
type = "momentum"
momentum = 0.9
"""
SMALL = {"num_samples": 10_000}


def _job(rank: int, args) -> None:
    overrides, out, slow = args.case
    torch.set_num_threads(1)
    strategy = Strategy.from_toml(STRATEGY).with_overrides(overrides)
    config = TrainConfig(task="mnist1d", model="cnn", task_options=SMALL, steps=args.steps,
                         out=out, progress=False, tensorboard=False, log_every=5)
    if strategy.parameter_server.enable:
        train_parameter_server(config, strategy, World.from_env(), slow_worker=slow)
    else:
        trainer.train(config, strategy)


def _run(args, world: int, overrides: list[str], out: Path, slow=None) -> dict:
    args.case = (overrides, str(out), slow)
    run_on_workers(_job, args, world)
    return json.loads((out / "summary.json").read_text())


def _same(a: Path, b: Path) -> bool:
    x, y = (torch.load(p / "final.pt", weights_only=True) for p in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the global batch")
    p.add_argument("--delay", type=float, default=0.1, help="seconds the slow worker sleeps")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="rounds of all five jobs")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    get_task("mnist1d", **SMALL)
    ps = ["parameter_server.servers=1"]
    stale = f"parameter_server.max_staleness={args.max_staleness}"
    cases = {"ddp": (2, [], None), "sync": (3, ps, None),
             "async": (3, [*ps, "parameter_server.mode=async", stale], None),
             "slow_sync": (3, ps, (1, args.delay)),
             "slow_async": (3, [*ps, "parameter_server.mode=async", stale], (1, args.delay))}
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    same = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):  # every case once per round: load hits them alike
            root = Path(tmp) / str(r)
            for name, (world, overrides, slow) in cases.items():
                runs[name].append(_run(args, world, overrides, root / name, slow))
            same.append(_same(root / "ddp", root / "sync"))
    best = {name: max(s["samples_per_s"] for s in rs) for name, rs in runs.items()}
    print(f"parameter server vs DDP: MNIST-1D CNN, global batch 128 (2 workers x 64), "
          f"{args.steps} steps, best samples/s of {args.repeats} rounds, torch {torch.__version__}")
    sync, ddp = runs["sync"][-1], runs["ddp"][-1]
    print(f"1. sync (1 server + 2 workers) vs DDP (2 workers): final weights and buffers "
          f"{'bit-identical' if all(same) else 'DIFFERENT'} in {sum(same)}/{len(same)} rounds; "
          f"samples/s sync {best['sync']:.0f}, DDP {best['ddp']:.0f} "
          f"({best['sync'] / best['ddp']:.2f}x); test accuracy {sync['test_accuracy']:.4f} / "
          f"{ddp['test_accuracy']:.4f}")
    hist = [r["parameter_server"] for r in runs["async"]]
    print(f"2. async staleness histograms (applied; max_staleness {args.max_staleness}): "
          + "; ".join(f"{h['staleness_histogram']} dropped {h['dropped']}" for h in hist)
          + f"; samples/s {best['async']:.0f}")
    a, s = runs["slow_async"][-1], runs["slow_sync"][-1]
    ai = [r["parameter_server"] for r in runs["slow_async"]]
    print(f"3. worker 1 slowed by {args.delay:g} s/step: samples/s sync {best['slow_sync']:.0f}, "
          f"async {best['slow_async']:.0f} ({best['slow_async'] / best['slow_sync']:.2f}x); "
          f"async staleness " + "; ".join(f"{h['staleness_histogram']} dropped {h['dropped']}"
                                          for h in ai)
          + f"; test accuracy sync {s['test_accuracy']:.4f}, async {a['test_accuracy']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
