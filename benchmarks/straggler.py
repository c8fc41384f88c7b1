"""Straggler detection: its cost per step, and warn against rebalance with one worker slowed 2x.

Two gloo workers on 127.0.0.1 train MNIST-1D's 1-D CNN through the engine
(summed losses with counts, as `bigbatch train` does).

1. **Cost, direct.** In one process: the timing hooks and bookkeeping alone, on
   and off in alternating steps of two identical models (no waits, so the load
   of other jobs hits both alike); the median per-pair difference.
2. **Cost, in place.** Three loops in rotating blocks in one process pair, so machine
   noise hits them alike: the straggler policy off, on (`warn`; step timing
   hooks on every parameter and every window one all-gather of four floats), and
   a second off loop whose ratio to the first is the noise floor. Reported per
   step, median and minimum over blocks (the minimum: the least disturbed block
   of each loop): the main thread's CPU time (where the hooks run) and the wall
   time, each as on/off with its noise floor off2/off (target: on/off <= 1.01).
3. **Slowed worker.** The parent process stops rank 1 with SIGSTOP for half of
   every `--period` (a CPU at half speed), and each worker pair then runs
   `--steps` steps from a fresh start under ``action = "warn"`` and under
   ``action = "rebalance"``, alternating, `--repeats` times. Reported: the median
   time to the step count for each, their ratio, the median step time over the
   last half of each run (after rebalancing settled), and the micro batches per
   rank that rebalancing ended with.

    .venv/bin/python benchmarks/straggler.py                     # both parts
    .venv/bin/python benchmarks/straggler.py --part cost --rounds 24
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _gloo import _entry, free_port  # noqa: E402

from bigbatch.config.strategy import Strategy  # noqa: E402
from bigbatch.engine import prepare  # noqa: E402
from bigbatch.tasks import get_task  # noqa: E402

WORLD = 2


def strategy(global_batch: int, action: str | None, interval: int) -> Strategy:
    d = {"batch": {"global_batch_size": global_batch, "base_batch_size": global_batch,
                   "base_lr": 0.05, "decay": "none"}}
    if action is not None:
        d["adaptive"] = {"policies": ["straggler"]}
        d["straggler"] = {"action": action, "interval_steps": interval, "patience": 2}
    return Strategy.from_dict(d)


class Loop:
    """An engine run whose steps split each global batch by `run.micro_batch_sizes`."""

    def __init__(self, task, s: Strategy, rank: int) -> None:
        torch.manual_seed(0)
        self.task, self.rank = task, rank
        self.run = prepare(task.build_model(), s, total_steps=10**6)
        self.gen = torch.Generator().manual_seed(1)  # the same global batches on both ranks

    def step(self) -> None:
        run, task = self.run, self.task
        x, y = task.train_set.tensors
        m, k = run.plan.micro_batch_size, run.k_steps
        shares = run.micro_batch_sizes or [m] * WORLD
        start = sum(shares[:self.rank])
        idx = torch.randint(0, len(x), (k, m * WORLD), generator=self.gen)
        for j in range(k):
            rows = idx[j, start:start + shares[self.rank]]
            with run.micro_step() as ms:
                loss_sum, count = task.loss(run.model(x[rows]), (x[rows], y[rows]))
                ms.backward(loss_sum, count=count)
        assert ms.stepped


def _cost(rank: int, args) -> None:
    task = get_task("mnist1d")
    loops = {"off": Loop(task, strategy(args.batch, None, args.interval), rank),
             "on": Loop(task, strategy(args.batch, "warn", args.interval), rank),
             "off2": Loop(task, strategy(args.batch, None, args.interval), rank)}
    policy = loops["on"].run.policies.get("straggler")
    windows: list[float] = []
    gather = policy._window

    def timed_window(run):
        t0 = time.perf_counter()
        gather(run)
        windows.append(time.perf_counter() - t0)

    policy._window = timed_window
    for loop in loops.values():
        for _ in range(args.warmup):
            loop.step()
    wall: dict[str, list[float]] = {name: [] for name in loops}
    cpu: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:  # rotate so no loop always goes first
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.block):
                loops[name].step()
            wall[name].append((time.perf_counter() - t0) / args.block)
            cpu[name].append((time.thread_time() - c0) / args.block)
    flags = loops["on"].run.policies.get("straggler").flags
    if rank == 0:
        print(f"straggler detection cost: {WORLD} gloo workers, MNIST-1D CNN, global batch "
              f"{args.batch}, {args.threads} thread(s) per worker, interval "
              f"{args.interval} steps, {args.rounds} blocks of {args.block} steps per loop, "
              f"torch {torch.__version__}")
        print(f"{'per step':>22} {'off ms':>9} {'on ms':>9} {'on/off':>7} {'off2/off (noise)':>17}")
        for what, t in (("main-thread CPU", cpu), ("wall", wall)):
            for stat, f in (("median", statistics.median), ("min", min)):
                m = {name: f(v) for name, v in t.items()}
                print(f"{what + ', ' + stat:>22} {m['off'] * 1e3:>9.2f} {m['on'] * 1e3:>9.2f} "
                      f"{m['on'] / m['off']:>7.3f} {m['off2'] / m['off']:>17.3f}")
        print(f"per window (every {args.interval} steps): gather and decision "
              f"{statistics.median(windows) * 1e3:.2f} ms median (waiting for the other rank "
              f"included), = {statistics.median(windows) / args.interval * 1e3:.3f} ms per step")
        print(f"flags raised in the even run: {len(flags)}")


def _slowed(rank: int, args) -> None:
    task = get_task("mnist1d")
    results: dict[str, list[float]] = {"warn": [], "rebalance": []}
    late: dict[str, list[float]] = {"warn": [], "rebalance": []}
    shares = None
    for rep in range(args.repeats):
        for action in ("warn", "rebalance") if rep % 2 == 0 else ("rebalance", "warn"):
            loop = Loop(task, strategy(args.batch, action, args.interval), rank)
            dist.barrier()
            t0 = time.perf_counter()
            stamps = []
            for _ in range(args.steps):
                loop.step()
                stamps.append(time.perf_counter())
            dist.barrier()
            results[action].append(time.perf_counter() - t0)
            half = stamps[args.steps // 2:]
            late[action].append((half[-1] - half[0]) / (len(half) - 1))
            if action == "rebalance":
                shares = loop.run.micro_batch_sizes
            flags = loop.run.policies.get("straggler").flags
            if rank == 0:
                print(f"  repeat {rep} {action:>9}: {results[action][-1]:7.2f} s, flags "
                      f"{[(f['step'], f['rank'], round(f['ratio'], 2)) for f in flags]}, "
                      f"micro batches {loop.run.micro_batch_sizes}", flush=True)
    if rank == 0:
        w, r = statistics.median(results["warn"]), statistics.median(results["rebalance"])
        lw, lr = statistics.median(late["warn"]), statistics.median(late["rebalance"])
        print(f"one worker slowed 2x (SIGSTOP half of every {args.period * 1e3:.0f} ms): "
              f"{args.steps} steps at global batch {args.batch}, interval {args.interval}, "
              f"median of {args.repeats}")
        print(f"{'':>24} {'warn':>8} {'rebalance':>10} {'warn/rebalance':>15}")
        print(f"{'time to the last step s':>24} {w:>8.2f} {r:>10.2f} {w / r:>15.2f}")
        print(f"{'last half ms/step':>24} {lw * 1e3:>8.1f} {lr * 1e3:>10.1f} {lw / lr:>15.2f}")
        print(f"final micro batches per rank under rebalance: {shares}")


def _direct(args) -> None:
    """The per-step work detection adds, in one process and free of any wait: the timing
    hooks (every parameter's post-accumulate-grad hook, two forward pre-hooks) and the
    bookkeeping, on and off in alternating steps of two identical models."""
    from types import SimpleNamespace

    from bigbatch.engine.step_timing import StepTiming

    torch.set_num_threads(args.threads)
    task = get_task("mnist1d")
    x, y = task.train_set.tensors
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        m = task.build_model()
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=0.01))
    timing = StepTiming()
    params = [p for p in models[1].parameters() if p.requires_grad]
    timing.install(SimpleNamespace(_ddp=models[1], _params=params, module=models[1],
                                   timing=None))
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, len(x), (args.batch // WORLD,), generator=g)

    def step(i: int) -> float:
        t0 = time.perf_counter()
        loss, count = task.loss(models[i](x[rows]), (x[rows], y[rows]))
        (loss / count).backward()
        if i:
            timing.backward_done(True)
        opts[i].step()
        opts[i].zero_grad(set_to_none=True)
        if i:
            timing.step_done(time.perf_counter() - t0)
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step(0), step(1)
    diffs, base = [], []
    for r in range(args.pairs):
        a, b = (step(0), step(1)) if r % 2 == 0 else (step(1), step(0))[::-1]
        diffs.append(b - a)
        base.append(a)
    d, b = statistics.median(diffs), statistics.median(base)
    print(f"timing hooks alone (one process, MNIST-1D CNN, batch {args.batch // WORLD}, "
          f"{len(params)} parameter tensors, {args.pairs} alternating pairs): "
          f"+{d * 1e6:.0f} us per step on a median step of {b * 1e3:.2f} ms = "
          f"{100 * d / b:+.2f}%")


def _spawn(fn, args, slow_rank: int | None = None) -> None:
    ctx = mp.spawn(_entry, args=(fn, args, WORLD, free_port()), nprocs=WORLD, join=False)
    stop = threading.Event()
    if slow_rank is not None:
        pid = ctx.processes[slow_rank].pid

        def loop():
            while not stop.is_set():
                try:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(args.period / 2)
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    return
                time.sleep(args.period / 2)

        threading.Thread(target=loop, daemon=True).start()
    try:
        while not ctx.join():
            pass
    finally:
        stop.set()
        if slow_rank is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ctx.processes[slow_rank].pid, signal.SIGCONT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("direct", "cost", "slowed", "both"), default="both",
                   help="both: direct, cost and slowed")
    p.add_argument("--pairs", type=int, default=400, help="direct: alternating step pairs")
    p.add_argument("--batch", type=int, default=512, help="global batch (both workers)")
    p.add_argument("--interval", type=int, default=20, help="straggler.interval_steps")
    p.add_argument("--rounds", type=int, default=16, help="cost: rotating blocks per loop")
    p.add_argument("--block", type=int, default=10, help="cost: steps per block")
    p.add_argument("--warmup", type=int, default=3, help="cost: untimed steps per loop first")
    p.add_argument("--steps", type=int, default=150, help="slowed: steps per run")
    p.add_argument("--repeats", type=int, default=4, help="slowed: runs per action")
    p.add_argument("--period", type=float, default=0.02,
                   help="slowed: seconds per SIGSTOP/SIGCONT cycle of rank 1")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker")
    args = p.parse_args(argv)
    get_task("mnist1d")  # fill the data cache once, before the workers
    if args.part in ("direct", "both"):
        _direct(args)
    if args.part in ("cost", "both"):
        _spawn(_cost, args)
    if args.part in ("slowed", "both"):
        _spawn(_slowed, args, slow_rank=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
