"""What a step sends that the meta device cannot run: the data-parallel reductions (DDP's
all-reduce, FSDP2's all-gathers, reduce-scatters and HSDP all-reduce), the pipeline's sends
and tied-weight sums, the engine's item count. Each is arithmetic on the laid-out model's
local shards, written from what those torch parts do per step (FSDP2's `foreach_reduce`
and `foreach_all_gather`, the pipeline schedules' order of forwards and backwards) and
checked against the same count taken on real gloo runs (tests/test_plan_dist.py).

Everything else a step sends (tensor parallelism, the optimizers' norm all-reduces,
Muon's all-to-alls and gathers of whole matrices, ZeRO-1's broadcasts, clipping) is
counted as the meta-device step issues it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from bigbatch.optim._norms import local
from bigbatch.planner.counting import CommCount

__all__ = ["ddp_traffic", "fsdp_gathers", "fsdp_traffic", "item_count_traffic",
           "nonfinite_flag_traffic", "pipeline_traffic", "schedule_order", "unit_params"]


def _add(count: CommCount, kind: str, group: Any, names: dict[str, str], nbytes: int,
         calls: int = 1) -> None:
    count.add(kind, names.get(group.group_name, "other"), nbytes, group.size(), calls)


def _storage_numel(t: torch.Tensor) -> int:
    """Elements of the storage behind `t`'s local shard: FSDP2 keeps each shard padded to
    ``ceil(dim0 / shards)`` rows, and pads what it gathers and reduces alike."""
    t = local(t)
    return t.untyped_storage().nbytes() // t.element_size()


def unit_params(units: Sequence[nn.Module], root: nn.Module | None) -> list[list[nn.Parameter]]:
    """The parameters of each FSDP unit as `fully_shard` groups them: each unit's own, then
    the root's (whatever no unit took), in that order; units without parameters left out."""
    taken: set[int] = set()
    groups = []
    for unit in [*units, *([root] if root is not None else [])]:
        mine = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in mine)
        if mine:
            groups.append(mine)
    return groups


def schedule_order(mode: str, micro: int, stage: int, stages: int) -> str:
    """This stage's forwards (F) and backwards (B) in one step, in order: GPipe runs all
    forwards first; 1F1B (and, as an estimate, each chunk of the interleaved schedule)
    runs ``min(m, stages - stage)`` forwards, then alternates, then drains the backwards."""
    if mode == "GPipe":
        return "F" * micro + "B" * micro
    warmup = min(micro, stages - stage)
    order = "F" * warmup
    forwards, backwards = warmup, 0
    while backwards < micro:
        order += "B"
        backwards += 1
        if forwards < micro:
            order += "F"
            forwards += 1
    return order


def fsdp_gathers(zero_stage: int, order: str, keep_after_backward: bool) -> int:
    """All-gathers of one FSDP unit in a step whose forwards and backwards come in `order`.

    A unit gathers whenever it runs sharded. ZeRO-3 reshards after every forward, ZeRO-2
    keeps what it gathered. After a backward that does not end the step, a pipeline stage
    keeps its parameters (torch's schedules turn resharding off until the last backward,
    `keep_after_backward`); the engine's merged micro-steps reshard after every backward."""
    sharded, gathers = True, 0
    last_backward = order.rfind("B")
    for i, op in enumerate(order):
        if sharded:
            gathers += 1
        after_backward = i == last_backward or not keep_after_backward
        sharded = zero_stage == 3 if op == "F" else after_backward
    return gathers


def fsdp_traffic(count: CommCount, groups: list[list[nn.Parameter]], mesh: Any,
                 names: dict[str, str], *, zero_stage: int, gathers: int,
                 gather_itemsize: int | None, reduce_itemsize: int | None) -> None:
    """FSDP2's collectives of one step over `groups` (`unit_params`): each unit all-gathers
    its padded parameters `gathers` times over ``dp_shard`` (in the mixed-precision
    dtype when `gather_itemsize`), reduce-scatters its gradients once (in
    `reduce_itemsize`, else the parameters' own), and under HSDP all-reduces its shard over
    ``dp_replicate``."""
    device_mesh = mesh.device_mesh
    shard = device_mesh["dp_shard"].get_group()
    replicate = device_mesh["dp_replicate"].get_group()
    for params in groups:
        local_numel = sum(_storage_numel(p) for p in params)
        own = local(params[0]).element_size()
        gather = local_numel * shard.size() * (gather_itemsize or own)
        reduce = local_numel * shard.size() * (reduce_itemsize or own)
        if shard.size() > 1:
            _add(count, "all_gather", shard, names, gather * gathers, gathers)
            _add(count, "reduce_scatter", shard, names, reduce)
        if replicate.size() > 1:
            _add(count, "all_reduce", replicate, names, reduce // shard.size())


def ddp_traffic(count: CommCount, params: Sequence[nn.Parameter], names: dict[str, str],
                itemsize: int | None, group: Any) -> None:
    """DDP's one all-reduce of every gradient per step (the merge window's last micro-step),
    in its buckets; `itemsize`: a compressing hook's dtype (fp16/bf16)."""
    nbytes = sum(p.numel() * (itemsize or p.element_size()) for p in params if p.requires_grad)
    _add(count, "all_reduce", group, names, nbytes)


def item_count_traffic(count: CommCount, group: Any, names: dict[str, str]) -> None:
    """The engine's all-reduce of the step's item count (one float64) for ``count=`` losses."""
    _add(count, "all_reduce", group, names, 8)


def nonfinite_flag_traffic(count: CommCount, group: Any, names: dict[str, str]) -> None:
    """The own loop's non-finite check (`nan_policy`, on by default outside fp16 and
    pipelines): one float32 flag all-reduced per optimizer step."""
    _add(count, "all_reduce", group, names, 4)


def pipeline_traffic(count: CommCount, sent: Sequence[int], received: Sequence[int],
                     micro: int, module: nn.Module, tied: Sequence[tuple[str, Any]],
                     pp_group: Any, names: dict[str, str]) -> None:
    """A pipeline rank's sends of one step: each stage's output forward and its input's
    gradient backward, once per micro-batch; then the sum of each weight tied across
    stages (its local gradient) over the ranks that hold it."""
    for nbytes in (*sent, *received):
        _add(count, "point_to_point", pp_group, names, nbytes * micro, micro)
    for name, group in tied:
        p = module.get_parameter(name)
        _add(count, "all_reduce", group, names, local(p).numel() * local(p).element_size())
