"""`--suggest`: the layouts of a world that fit a GPU, fastest first (by the time model,
`bigbatch.planner.timing`; least traffic first without a device).

Candidates keep the strategy's global batch and micro-batch and vary the tensor degree
(powers of two up to 8: one node's NVLink domain), the pipeline degree (powers of two up
to 8, with the accumulation as its micro-batches) and the ZeRO stage (none, 1, 2, 3).
Each is planned like any other (`bigbatch.planner.planning`), a pipeline's first and
last stage only; a candidate the engine refuses is skipped. To keep this to minutes for
a model of tens of billions of parameters: plans that differ only in their ZeRO stage
share one micro-batch probe, and ZeRO-3 (the least memory) is planned first: when it
does not fit, the other stages of that tensor and pipeline degree are not tried. "Least
traffic" (the order without a device) is the bytes the busiest rank sends per step under
ring algorithms (`bigbatch.planner.counting.wire_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from bigbatch.config.parallelism import degrees
from bigbatch.errors import ConfigError
from bigbatch.planner.counting import wire_bytes

__all__ = ["candidates", "suggest"]

MAX_TENSOR = 8
MAX_PIPELINE = 8


def _powers(limit: int, world: int) -> list[int]:
    out, n = [], 1
    while n <= limit and world % n == 0:
        out.append(n)
        n *= 2
    return out


def base_batch(strategy: Any, world: int) -> tuple[int, int]:
    """(global batch, micro-batch) the candidates keep: the strategy's at its own layout."""
    try:
        plan = strategy.ceiling(degrees(strategy, world).data)
        return plan.global_batch_size, plan.micro_batch_size
    except ConfigError:
        micro = strategy.batch.micro_batch_size or strategy.pipeline.micro_batch_size or 1
        given = strategy.batch.global_batch_size
        return (given if given is not None else micro * world), micro


def candidates(strategy: Any, world: int) -> Iterator[tuple[list[str], Any]]:
    """(the `--set` overrides, the strategy) of each layout to try."""
    total, micro = base_batch(strategy, world)
    for tensor in _powers(MAX_TENSOR, world):
        for stages in _powers(MAX_PIPELINE, world // tensor):
            data = world // (tensor * stages)
            if total % (data * micro):
                continue
            k = total // (data * micro)
            if stages > 1 and k < stages:
                continue
            sets = [f"tensor_parallel.tensor_parallel_degree={tensor}",
                    f"batch.global_batch_size={total}", f"batch.micro_batch_size={micro}"]
            if stages > 1:
                sets += ["pipeline.enable=true", f"pipeline.pp_degree={stages}",
                         f"pipeline.accumulate_steps={k}", "gradient_merge.enable=false"]
            else:
                sets += ["pipeline.enable=false"]
                sets += ([f"gradient_merge.k_steps={k}"] if k > 1
                         else ["gradient_merge.enable=false"])
            for zero in (3, 0, 1, 2) if data > 1 else (0,):  # one rank has nothing to shard
                shard = [f"sharding.stage={zero}"] if zero else ["sharding.enable=false"]
                try:
                    yield sets + shard, strategy.with_overrides(sets + shard)
                except ConfigError:
                    continue


def suggest(strategy: Any, world: int, plan_one: Callable[[Any, dict], Any],
            gpu_memory: float | None, seconds: Callable[[Any], float] | None = None
            ) -> tuple[list[tuple[Any, list[str]]], int]:
    """Plan every candidate with `plan_one(strategy, probes)`; return the ones that fit
    `gpu_memory` GiB (all, without it) as (plan, overrides), fastest first by
    `seconds(plan)` (a predicted step time), else least traffic first, and how many were
    tried."""
    probes: dict = {}
    fitting, tried, too_big = [], 0, set()
    for sets, candidate in candidates(strategy, world):
        shape = tuple(s for s in sets if not s.startswith("sharding"))
        if shape in too_big:
            continue
        tried += 1
        try:
            planned = plan_one(candidate, probes)
        except ConfigError:
            continue
        if planned.fits is False and planned.degrees.stage == 3:
            too_big.add(shape)
        if planned.fits is not False:
            shown = [s for s in sets if not s.endswith("=false") and "batch" not in s
                     and not s.endswith("_degree=1")]
            fitting.append((planned, shown))
    if seconds is not None:
        fitting.sort(key=lambda row: (seconds(row[0]), row[0].worst.peak))
    else:
        fitting.sort(key=lambda row: (wire_bytes(row[0].busiest.comm), row[0].worst.peak))
    return fitting, tried
