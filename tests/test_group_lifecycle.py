"""A job that closes its process group and makes another, in the same processes
(`run.close()`, then `prepare()` again; a sweep or a train-then-evaluate script). Each
new group must meet its own peers: before one store was kept for the job and each group
keyed apart, a fast rank could reach rank 0's previous store, read the previous group's
gloo addresses, and leave rank 0 waiting forever in the new group's connect."""

from __future__ import annotations

import time

import torch
from _dist import run_workers

from bigbatch.parallel.world import World, init_distributed, teardown

ROUNDS = 6


def _rounds() -> list[float]:
    import torch.distributed as dist

    sums = []
    for i in range(ROUNDS):
        world = init_distributed(world=World.from_env())
        t = torch.tensor([float(world.rank + 1 + i)])
        dist.all_reduce(t)
        sums.append(t.item())
        if world.rank == 0:
            time.sleep(0.3)  # rank 0 late to leave: rank 1 makes the next group first
        teardown()
    return sums


def test_a_group_made_again_after_teardown_meets_its_own_peers():
    per_rank = run_workers(_rounds, world_size=2, timeout=60)
    assert per_rank[0] == per_rank[1] == [3.0 + 2 * i for i in range(ROUNDS)]
