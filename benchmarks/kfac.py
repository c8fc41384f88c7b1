"""K-FAC step time against momentum SGD on the MNIST-1D CNN, at inv_update_freq 1, 10, 100.

One process trains the task's CNN through the engine (`prepare`) at one global batch
(default 1024 = micro 128 x 8 merged micro-steps, the study's layout) with plain
momentum SGD and with `[kfac]` on top at several eigendecomposition intervals. All
loops live in one process and run in rotating blocks of `--block` steps, so machine
noise hits them alike; a second SGD loop gives the noise floor. K-FAC's costs are
amortised (a decomposition every `inv_update_freq` steps), so the figure is the
mean step time over whole intervals (each loop runs a multiple of 100 steps), with
the median beside it; ratios are against the first SGD loop. Target: <= 1.5x at 10.

Measured on the 2-core dev box, quiet, defaults (factor_update_freq 10): mean/sgd at
inv_update_freq 1 / 10 / 100 = 2.18 / 1.30 / 1.20 and 2.19 / 1.31 / 1.22 (noise floor
0.995, 1.002). Earlier, on the box at load 8-11: with --factor-freq 1, 3.06 / 2.32 /
2.47 and 2.90 / 2.39 / 2.05; with 10, 2.16 / 1.47 / 1.39 and 1.77 / 1.15 / 1.19. With
factors every step (--factor-freq 1) the target is missed: the factor
products (d^2 per row: 641^2 for the 640-wide head, 192^2 x 10 positions for conv3;
~0.97 M multiply-adds a sample for the inputs, ~0.16 M for the output gradients) cost
more than the CNN's forward and backward (~0.78 M), so that case stays above ~2x.

    .venv/bin/python benchmarks/kfac.py                    # batch 1024, 100 steps a loop
    .venv/bin/python benchmarks/kfac.py --batch 4096 --rounds 10 --block 10
    .venv/bin/python benchmarks/kfac.py --factor-freq 1    # fresh factors every step
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bigbatch.config.strategy import Strategy  # noqa: E402
from bigbatch.engine import prepare  # noqa: E402
from bigbatch.parallel.world import World  # noqa: E402
from bigbatch.tasks import get_task  # noqa: E402


def strategy(batch: int, micro: int, kfac: dict | None) -> Strategy:
    d = {"batch": {"global_batch_size": batch, "micro_batch_size": micro, "base_batch_size": 128,
                   "base_lr": 0.1, "scaling": "linear", "decay": "none"},
         "optimizer": {"type": "momentum", "momentum": 0.9, "weight_decay": 5e-4}}
    if batch > micro:
        d["gradient_merge"] = {"avg": True}
    if kfac is not None:
        d["kfac"] = kfac
    return Strategy.from_dict(d)


class Loop:
    def __init__(self, task, s: Strategy) -> None:
        torch.manual_seed(0)
        self.task = task
        self.run = prepare(task.build_model("cnn"), s, total_steps=10**6, world=World())

    def step(self, micro_batches) -> None:
        run = self.run
        for x, y in micro_batches:
            with run.micro_step() as ms:
                loss_sum, count = self.task.loss(run.model(x), (x, y))
                ms.backward(loss_sum, count=count)
        assert ms.stepped


def batches(task, plan, n: int):
    x, y = task.train_set.tensors
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(x), (plan.k_steps, plan.micro_batch_size), generator=g)
        out.append([(x[i], y[i]) for i in idx])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1024, help="global batch")
    p.add_argument("--micro", type=int, default=128, help="micro batch (merge above it)")
    p.add_argument("--freqs", default="1,10,100", help="inv_update_freq values")
    p.add_argument("--factor-freq", type=int, default=10,
                   help="factor_update_freq of every loop (default 10, the [kfac] default)")
    p.add_argument("--rounds", type=int, default=10, help="rotating blocks per loop")
    p.add_argument("--block", type=int, default=10, help="optimizer steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per loop first")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = get_task("mnist1d")
    freqs = [int(f) for f in args.freqs.split(",")]
    loops = {"sgd": Loop(task, strategy(args.batch, args.micro, None))}
    for f in freqs:
        loops[f"kfac inv {f}"] = Loop(task, strategy(
            args.batch, args.micro, {"inv_update_freq": f, "factor_update_freq": args.factor_freq}))
    loops["sgd again"] = Loop(task, strategy(args.batch, args.micro, None))
    plan = loops["sgd"].run.plan
    data = batches(task, plan, 8)
    for loop in loops.values():
        for i in range(args.warmup):
            loop.step(data[i % len(data)])
    # Warm-up steps moved K-FAC's step counter off its interval: start every loop on one.
    for loop in loops.values():
        loop.run.step = 0
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for i in range(args.block):
                t0 = time.perf_counter()
                loops[name].step(data[i % len(data)])
                times[name].append(time.perf_counter() - t0)
    base = statistics.fmean(times["sgd"])
    print(f"K-FAC step time vs momentum SGD: MNIST-1D CNN, global batch {plan.global_batch_size} "
          f"({plan.micro_batch_size} x {plan.k_steps} merged), 1 process, {args.threads} "
          f"thread(s), factor_update_freq {args.factor_freq}, {args.rounds * args.block} steps "
          f"a loop in blocks of {args.block}, torch {torch.__version__}")
    print(f"{'loop':>12} {'mean ms':>9} {'median ms':>10} {'mean/sgd':>9} {'median/sgd':>11}")
    med_base = statistics.median(times["sgd"])
    for name, t in times.items():
        mean, med = statistics.fmean(t), statistics.median(t)
        print(f"{name:>12} {mean * 1e3:>9.1f} {med * 1e3:>10.1f} {mean / base:>9.3f} "
              f"{med / med_base:>11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
