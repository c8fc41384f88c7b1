"""The checkpoint a resume starts from: the newest one every rank found whole.

Rank 0 picks the newest checkpoint whose payload, manifest and DCP index check out and
whose files are all there at their sizes (`latest_checkpoint`). The shards' digests are
then checked by all the workers together, each rank hashing its share of the files
(`bigbatch.train.sharded.shard_problem`), and the verdict is agreed before anything is
loaded: a damaged checkpoint makes every rank move on to the next older good one, and
rank 0 says which and why in one line; when none is left, every rank raises
`CheckpointDamagedError` (one line, exit 1).
"""

from __future__ import annotations

import os
from pathlib import Path

from bigbatch.parallel.world import World, broadcast, gather
from bigbatch.train.checkpoint import damaged_error, newest_whole, warn_damaged
from bigbatch.train.sharded import shard_problem

__all__ = ["agree_on_checkpoint"]


def agree_on_checkpoint(out: str | os.PathLike, first: Path, world: World) -> Path:
    """Collective: `first` (rank 0's choice) or the newest older checkpoint whose shards
    every rank verified; raises `CheckpointDamagedError` on every rank when none is."""
    candidate: Path | None = first
    bad: list[tuple[Path, str]] = []
    while candidate is not None:
        problems = gather(shard_problem(candidate, world.rank, world.world_size), world)
        problem = next((p for p in problems if p is not None), None)
        if problem is None:
            break
        bad.append((candidate, problem))
        older, skipped = newest_whole(out, before=candidate) if world.is_main else (None, [])
        bad += skipped
        candidate = broadcast(older, world)
    if candidate is None:
        error = damaged_error(out, bad)
        error.everywhere = True
        raise error
    if world.is_main:
        warn_damaged(bad, candidate)
    return candidate
