"""`bigbatch plan --calibrate FILE`: measure this machine into a device file.

Three measurements, each a median of repeats, one thread per rank as the tests and
benchmarks run (OMP_NUM_THREADS=1):

- the matrix-product rate (float32 and bfloat16 ``n x n @ n x n``, n = 512);
- the copy bandwidth (a 64 MiB tensor copied; bytes read plus written) and the cost of
  a tiny kernel (an add of two 1-element tensors: the per-operator overhead);
- a gloo all-reduce over 2 local processes on 127.0.0.1 at 4 KiB and 16 MiB: the latency
  and bandwidth of the ring model (``2 (n-1) hop + 2 (n-1)/n s / rate``) solved from two
  points. Both ranks are on this machine: its "node" holds 2 ranks and the same figures
  serve between nodes.

The first two's functions (`matmul_rate`, `copy_bandwidth`, `kernel_overhead`) take a
`device` (default the CPU): on CUDA each timing waits for the device
(``torch.cuda.synchronize``) before it starts and before it stops, and a product needs a
larger ``n`` to reach the rate (benchmarks/plan_time_gpu.py uses 4096).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bigbatch.errors import ConfigError
from bigbatch.planner.devices import Device, Link, device_toml

__all__ = ["calibrate", "calibrate_to"]

TIMEOUT_S = 60.0


def _sync(device: torch.device | str) -> Callable[[], None]:
    """What waits for `device`'s queued work (nothing on the CPU: it runs in order)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _median_time(fn: Callable[[], object], repeats: int = 7, inner: int = 1,
                 device: torch.device | str = "cpu") -> float:
    sync = _sync(device)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def matmul_rate(dtype: torch.dtype, n: int = 512, device: torch.device | str = "cpu") -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _median_time(lambda: a @ b, repeats=5, inner=3, device=device)


def copy_bandwidth(nbytes: int = 64 * 2**20, device: torch.device | str = "cpu") -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), repeats=7, device=device)


def kernel_overhead(device: torch.device | str = "cpu") -> float:
    """Seconds per tiny kernel run back to back: on CUDA the host's launch rate, the floor
    of an eager step's small operators."""
    a, b = torch.ones(1, device=device), torch.ones(1, device=device)
    return _median_time(lambda: torch.add(a, b), repeats=7, inner=2000, device=device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(rank: int, port: int, sizes: list[int], out: object) -> None:
    import datetime

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4))
            times = []
            for i in range(9):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                if i:
                    times.append(time.perf_counter() - start)
            if rank == 0:
                out[nbytes] = statistics.median(times)
    finally:
        dist.destroy_process_group()


def allreduce_curve(sizes: tuple[int, ...] = (4096, 16 * 2**20)) -> dict[int, float]:
    """Median seconds of a gloo all-reduce of each size over 2 local processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_allreduce_worker, args=(r, port, list(sizes), out))
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 2 * TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if hung or any(p.exitcode for p in procs) or len(out) != len(sizes):
            raise ConfigError("--calibrate: the gloo all-reduce over 2 local processes did "
                              "not finish (is 127.0.0.1 usable?)")
        return dict(out)


def link_from_curve(curve: dict[int, float], ranks: int = 2) -> Link:
    """The ring model's hop latency and rate through the smallest and largest points."""
    small, large = min(curve), max(curve)
    factor = 2 * (ranks - 1) / ranks
    per_byte = max(1e-15, (curve[large] - curve[small]) / (large - small))
    rate = factor / per_byte
    hop = max(1e-7, (curve[small] - factor * small / rate) / (2 * (ranks - 1)))
    return Link(bandwidth=rate, latency=hop, efficiency=1.0)


def calibrate() -> Device:
    """This machine as a `Device` (one rank per core)."""
    torch.set_num_threads(1)
    fp32, bf16 = matmul_rate(torch.float32), matmul_rate(torch.bfloat16)
    link = link_from_curve(allreduce_curve())
    cores = os.cpu_count() or 1
    return Device(
        name=f"{socket.gethostname()} CPU, one thread per rank",
        flops={"float32": fp32, "bfloat16": bf16, "float16": bf16},
        memory_bandwidth=copy_bandwidth(), intra=link, inter=link,
        gpus_per_node=max(2, cores), matmul_efficiency=1.0, attention_efficiency=1.0,
        memory_efficiency=1.0, kernel_overhead=kernel_overhead(),
        source=f"bigbatch plan --calibrate, {time.strftime('%Y-%m-%d')}: 512^3 products, a "
               "64 MiB copy, a 1-element add, a gloo all-reduce of 4 KiB and 16 MiB over 2 "
               "local processes (medians)")


def calibrate_to(path: Path) -> str:
    """Calibrate and write the device file; returns a one-paragraph summary."""
    if path.exists() and path.is_dir():
        raise ConfigError(f"--calibrate {path}: is a folder; give a file name")
    if not path.parent.is_dir():
        raise ConfigError(f"--calibrate {path}: no folder {path.parent}")
    dev = calibrate()
    path.write_text(device_toml(dev))
    return (f"wrote {path}: float32 products {dev.flops['float32'] / 1e9:.1f} GFLOP/s, "
            f"bfloat16 {dev.flops['bfloat16'] / 1e9:.1f}, copy "
            f"{dev.memory_bandwidth / 1e9:.1f} GB/s, {dev.kernel_overhead * 1e6:.1f} us a "
            f"kernel, gloo {dev.intra.bandwidth / 1e9:.2f} GB/s and "
            f"{dev.intra.latency * 1e6:.0f} us a hop")
