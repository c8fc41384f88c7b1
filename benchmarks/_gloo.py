"""Run a benchmark's measurement on gloo workers on this machine (the 2-worker benchmarks).

    run_on_workers(measure, args, world=2)

`measure(rank, args)` runs in each spawned worker, inside a process group made
from the torchrun-style environment, with `args.threads` intra-op threads.
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bigbatch.parallel.world import init_distributed, teardown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, measure: Callable[[int, Any], None], args: Any, world: int,
           port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    init_distributed()
    try:
        measure(rank, args)
        dist.barrier()
    finally:
        # The DDP models `measure` built must go before the group: freed after it, a gloo
        # worker can hang or abort at exit (see bigbatch.train.trainer.train).
        gc.collect()
        teardown()


def run_on_workers(measure: Callable[[int, Any], None], args: Any, world: int = 2) -> None:
    mp.spawn(_entry, args=(measure, args, world, free_port()), nprocs=world, join=True)
