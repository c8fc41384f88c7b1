"""Gradient traffic per reduce mode: bytes each worker hands to collectives per optimizer
step, against the mean, and the engine's step time, on 2 gloo workers.

Modes: the mean (DDP's all-reduce), fp16 and bf16 (the mean sent at half precision),
PowerSGD (rank 1 and 2), DGC (sparsity 0.999 and 0.99 on tensors of 1000+ elements; at
Fleet's 16384 the CNN would have none) and local SGD (models averaged every 4 steps).
Bytes are measured, not derived: for a few steady-state steps per mode
(after PowerSGD's uncompressed start and DGC's warm-up) the worker counts the bytes of
every tensor passed to `dist.all_reduce` / `all_gather_single` (the mean through torch's
Python `allreduce_hook`, byte for byte what DDP's C++ all-reduce sends). At 2 workers a
ring all-reduce and a ring all-gather both put exactly that payload on the wire per
worker (2(W-1)/W x payload and (W-1) x payload).

Step times come from rotating blocks of steps in one process pair, so machine noise hits
every mode alike; `mean2/mean` is the noise floor. The ratio is each mode's median step
time over the mean's.

    .venv/bin/python benchmarks/comm.py                    # MLP and CNN
    .venv/bin/python benchmarks/comm.py --model mlp --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _gloo import run_on_workers  # noqa: E402

from bigbatch.config.strategy import Strategy  # noqa: E402
from bigbatch.engine import prepare  # noqa: E402
from bigbatch.tasks import get_task  # noqa: E402

WORLD = 2
BASE = """
[batch]
global_batch_size = 1024
micro_batch_size = 512
base_batch_size = 128
base_lr = 0.1
decay = "none"
[optimizer]
type = "momentum"
momentum = 0.9
"""
MODES = {
    "mean": [],
    "fp16": ["data_parallel.reduce=fp16"],
    "bf16": ["data_parallel.reduce=bf16"],
    "powersgd r1": ["data_parallel.reduce=powersgd", "data_parallel.powersgd_rank=1",
                    "data_parallel.start_powersgd_iter=2"],
    "powersgd r2": ["data_parallel.reduce=powersgd", "data_parallel.powersgd_rank=2",
                    "data_parallel.start_powersgd_iter=2"],
    "dgc 0.99": ["data_parallel.reduce=dgc", "dgc.sparsity=[0.99]", "dgc.min_numel=1000"],
    "dgc 0.999": ["data_parallel.reduce=dgc", "dgc.sparsity=[0.999]", "dgc.min_numel=1000"],
    "localsgd k4": ["localsgd.k_steps=4"],
    "mean2": [],
}
WARMUP = 4  # steps before counting: PowerSGD compresses from step 3, local SGD from step 2


class Loop:
    def __init__(self, task, model_name: str, overrides: list[str]) -> None:
        torch.manual_seed(0)
        self.task = task
        strategy = Strategy.from_toml(BASE).with_overrides(overrides)
        self.run = prepare(task.build_model(model_name), strategy, total_steps=10**6)

    def step(self, micro_batches) -> None:
        run, task = self.run, self.task
        for x, y in micro_batches:
            with run.micro_step() as ms:
                loss_sum, count = task.loss(run.model(x), (x, y))
                ms.backward(loss_sum, count=count)
        assert ms.stepped


@contextmanager
def counting(box: list[int]):
    """Add the bytes of every tensor handed to all_reduce / all_gather_single to box[0]."""
    saved = dist.all_reduce, dist.all_gather_single

    def all_reduce(tensor, *a, **kw):
        box[0] += tensor.numel() * tensor.element_size()
        return saved[0](tensor, *a, **kw)

    def all_gather_single(output, tensor, *a, **kw):
        box[0] += tensor.numel() * tensor.element_size()
        return saved[1](output, tensor, *a, **kw)

    dist.all_reduce, dist.all_gather_single = all_reduce, all_gather_single
    try:
        yield
    finally:
        dist.all_reduce, dist.all_gather_single = saved


def _batches(task, plan, n: int, rank: int):
    x, y = task.train_set.tensors
    g = torch.Generator().manual_seed(1 + rank)
    return [[(x[i], y[i]) for i in torch.randint(0, len(x), (plan.k_steps,
                                                                plan.micro_batch_size),
                                                   generator=g)] for _ in range(n)]


def _bytes_per_step(task, model_name: str, overrides: list[str], batches, steps: int) -> float:
    loop = Loop(task, model_name, overrides)
    if not overrides:  # the mean: torch's Python all-reduce hook, so its bytes are seen
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        loop.run.model.register_comm_hook(None, allreduce_hook)
    for i in range(WARMUP):
        loop.step(batches[i])
    box = [0]
    with counting(box):
        for i in range(steps):
            loop.step(batches[WARMUP + i])
    count_bytes = 8  # the engine's item count (float64), sent every step in every mode
    return box[0] / steps - count_bytes


def _measure(rank: int, args) -> None:
    task = get_task("mnist1d")
    models = ["mlp", "cnn"] if args.model == "both" else [args.model]
    report = []
    for model_name in models:
        probe = Loop(task, model_name, [])
        plan = probe.run.plan
        numel = sum(p.numel() for p in probe.run.module.parameters())
        batches = _batches(task, plan, 16, rank)
        traffic = {m: _bytes_per_step(task, model_name, o, batches, args.count_steps)
                   for m, o in MODES.items() if m != "mean2"}
        loops = {m: Loop(task, model_name, o) for m, o in MODES.items()}
        for loop in loops.values():
            for i in range(WARMUP):
                loop.step(batches[i])
        times = {m: [] for m in loops}
        names = list(loops)
        for r in range(args.rounds):
            shift = r % len(names)
            for m in names[shift:] + names[:shift]:
                dist.barrier()
                for i in range(args.block):
                    t0 = time.perf_counter()
                    loops[m].step(batches[(r * args.block + i) % len(batches)])
                    times[m].append(time.perf_counter() - t0)
        report.append((model_name, numel, plan, traffic,
                       {m: statistics.median(t) for m, t in times.items()}, len(times["mean"])))
    if rank == 0:
        print(f"gradient traffic per optimizer step: {WORLD} gloo workers, MNIST-1D, "
              f"{args.threads} thread(s) per worker, torch {torch.__version__}")
        for model_name, numel, plan, traffic, med, n in report:
            print(f"\n{model_name}: {numel} parameters, global batch {plan.global_batch_size} "
                  f"({plan.micro_batch_size} x {plan.k_steps} x {plan.world_size}); "
                  f"{n} timed steps per mode")
            print(f"{'mode':>12} {'bytes/step':>11} {'/ mean':>8} {'ms/step':>9} {'/ mean':>7}")
            for m in MODES:
                b = traffic.get(m, traffic["mean"])
                print(f"{m:>12} {b:>11.0f} {b / traffic['mean']:>8.4f} {med[m] * 1e3:>9.1f} "
                      f"{med[m] / med['mean']:>7.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "cnn", "both"), default="both")
    p.add_argument("--rounds", type=int, default=6, help="rotating blocks per mode")
    p.add_argument("--block", type=int, default=3, help="optimizer steps per block")
    p.add_argument("--count-steps", type=int, default=4, help="steps whose bytes are counted")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker")
    args = p.parse_args(argv)
    get_task("mnist1d")  # fill the data cache once, before the workers
    run_on_workers(_measure, args, WORLD)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
