"""How long a planned step takes on a device: compute, exposed communication, bubble,
optimizer.

    t = step_time(plan, device("h100"))
    t.seconds, t.breakdown(), t.mfu, t.per_device_rate

The parts, each from what the plan already measured:

- **compute**: the rank's operators for one micro-batch, forward and backward (recompute
  included), on the meta device (`bigbatch.planner.cost`): each kernel's roofline on the
  device, times the micro-batches of a step.
- **collectives** (`collective_seconds`): a ring (all-gather, reduce-scatter; all-reduce
  as the faster of a ring and a tree), ``hops x latency + wire bytes / bandwidth`` on the
  link a mesh dimension spans. The mesh is ``pp x dp_replicate x dp_shard x tp`` with
  tensor ranks innermost: a dimension whose ranks fit in one node uses the node's links
  (NVLink), else the network, where g of its ranks in a node share g NICs.
- **overlap**, per engine: tensor parallelism runs inside the layers, synchronously
  (no async TP): all exposed. DDP all-reduces its buckets during the last micro-batch's
  backward: exposed is what outlasts that backward, at least the last 25 MiB bucket.
  FSDP2 prefetches the next unit's all-gather and reduce-scatters behind the backward:
  exposed is what outlasts all compute, plus one unit's gather (the first) and one
  reduce-scatter (the last). ZeRO-1's broadcasts after the step, tied-weight sums and
  anything else are exposed.
- **pipeline**: ``(p - 1) / v`` stage-micro-batch times of bubble (GPipe and 1F1B: v = 1;
  interleaved: v chunks per rank), the slowest stage setting the pace; activations'
  sends on the fill and drain path exposed, those in the steady state hidden.
- **optimizer**: the strategy's optimizer step on meta, costed by its kernels' bytes: a
  steady step (the second; the first fills the new state), its host bookkeeping (step
  counters) left out.

MFU is the model's FLOPs (3 x the forward's: recompute not counted) per second over the
device's peak in the step's dtype; TFLOP/s per GPU counts every FLOP run (recompute
included, as Megatron-LM reports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bigbatch.planner.counting import CommCount
from bigbatch.planner.devices import Device

__all__ = ["StepTime", "collective_seconds", "dim_link", "step_time"]

DDP_BUCKET = 25 * 2**20
"""DDP's default bucket (bucket_cap_mb=25): the last one cannot hide behind backward."""
BACKWARD_SHARE = 2 / 3
"""A backward's share of one forward plus backward (two products for each forward one)."""
DATA_DIMS = ("dp", "dp_shard", "dp_replicate", "world")


def dim_link(dev: Device, stride: int, size: int) -> tuple[float, float]:
    """(bytes/s, seconds per hop) of a mesh dimension of `size` ranks `stride` apart."""
    per_node = dev.gpus_per_node
    if stride * size <= per_node:
        return dev.intra.rate, dev.intra.latency
    members = max(1, min(size, per_node // stride)) if stride < per_node else 1
    return min(dev.intra.rate, members * dev.inter.rate), dev.inter.latency


def collective_seconds(kind: str, nbytes: float, ranks: int, link: tuple[float, float],
                       calls: int = 1) -> float:
    """`calls` collectives of `kind` handing `nbytes` in all to torch over `ranks` ranks."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    rate, hop = link
    s, n = nbytes / calls, ranks
    if kind == "all_reduce":
        ring = 2 * (n - 1) * hop + 2 * (n - 1) / n * s / rate
        tree = 2 * math.ceil(math.log2(n)) * hop + 2 * s / rate
        one = min(ring, tree)
    elif kind in ("all_gather", "reduce_scatter", "all_to_all"):
        one = (n - 1) * hop + (n - 1) / n * s / rate
    elif kind == "broadcast":
        one = math.ceil(math.log2(n)) * hop + s / rate
    else:  # point_to_point
        one = hop + s / rate
    return one * calls


def _strides(deg: Any) -> dict[str, int]:
    t, s, r = deg.tensor, deg.shard, deg.replicate
    return {"tp": 1, "dp_shard": t, "dp_replicate": t * s, "dp": t, "pp": t * s * r,
            "world": 1, "other": 1}


def _comm_seconds(count: CommCount, dev: Device, deg: Any,
                  kinds: tuple[str, ...] | None = None) -> dict[str, float]:
    """Seconds per mesh dimension of the collectives in `count` (of `kinds`, or all)."""
    strides = _strides(deg)
    out: dict[str, float] = {}
    for kind, dims in count.bytes.items():
        if kinds is not None and kind not in kinds:
            continue
        for dim, nbytes in dims.items():
            n = count.sizes[dim]
            link = dim_link(dev, strides.get(dim, 1), n)
            calls = count.calls[kind][dim]
            out[dim] = out.get(dim, 0.0) + collective_seconds(kind, nbytes, n, link, calls)
    return out


def _add(into: dict[str, float], more: dict[str, float]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + v


@dataclass
class RankTime:
    """One simulated rank's step."""

    rank: int
    compute: float
    """Seconds of its operators in a step (all micro-batches)."""
    micro: float
    """Seconds of one micro-batch, its tensor-parallel collectives included."""
    exposed: dict[str, float] = field(default_factory=dict)
    """Seconds of communication not hidden behind compute, per mesh dimension."""
    optimizer: float = 0.0
    flops: float = 0.0
    """FLOPs it runs in a step (recompute included)."""
    forward_flops: float = 0.0
    """Its forward's FLOPs in a step."""

    @property
    def busy(self) -> float:
        return self.compute + sum(self.exposed.values()) + self.optimizer


@dataclass
class StepTime:
    """A layout's predicted step on one device (see the module docstring)."""

    device: str
    seconds: float
    compute: float
    exposed: dict[str, float]
    bubble: float
    optimizer: float
    samples_per_step: int
    tokens_per_sample: int | None
    world: int
    model_flops: float
    """The model's FLOPs in one step, all ranks (3 x forward)."""
    hardware_flops: float
    """Every FLOP run in one step, all ranks (recompute included)."""
    peak: float
    """The device's peak FLOP/s in the step's dtype."""
    dtype: str

    def breakdown(self) -> dict[str, float]:
        """Seconds: compute, exposed communication per dimension, bubble, optimizer; they
        sum to `seconds`."""
        return {"compute": self.compute,
                **{f"comm_{dim}": t for dim, t in sorted(self.exposed.items())},
                "bubble": self.bubble, "optimizer": self.optimizer}

    @property
    def per_device_rate(self) -> float:
        """Tokens (or samples, when the input is not token ids) per second per device."""
        items = self.samples_per_step * (self.tokens_per_sample or 1)
        return items / self.seconds / self.world

    @property
    def unit(self) -> str:
        return "tokens" if self.tokens_per_sample else "samples"

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.seconds * self.world * self.peak)

    @property
    def tflops_per_device(self) -> float:
        """TFLOP/s each device runs, recompute included (Megatron-LM's convention)."""
        return self.hardware_flops / self.seconds / self.world / 1e12

    @property
    def model_tflops_per_device(self) -> float:
        return self.model_flops / self.seconds / self.world / 1e12

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "step_seconds": self.seconds,
                "breakdown_seconds": self.breakdown(),
                f"{self.unit}_per_second_per_device": self.per_device_rate,
                "mfu": self.mfu, "tflops_per_device": self.tflops_per_device,
                "model_tflops_per_device": self.model_tflops_per_device,
                "dtype": self.dtype}


def _data_exposed(r: Any, dev: Device, deg: Any, compute: float, micro: float,
                  fsdp: bool) -> dict[str, float]:
    """Exposed seconds of the data-parallel reductions (`r.data_comm`) by the engine's
    overlap (module docstring)."""
    out: dict[str, float] = {}
    count = r.data_comm
    strides = _strides(deg)
    overlappable = ("all_reduce", "all_gather", "reduce_scatter")
    for dim in set(count.sizes):
        n = count.sizes[dim]
        link = dim_link(dev, strides.get(dim, 1), n)
        total, floor = 0.0, 0.0
        for kind in overlappable:
            nbytes = count.bytes.get(kind, {}).get(dim, 0)
            if not nbytes:
                continue
            calls = count.calls[kind][dim]
            if dim not in DATA_DIMS:
                out[dim] = out.get(dim, 0.0) + collective_seconds(kind, nbytes, n, link, calls)
                continue
            if not fsdp and kind == "all_reduce" and nbytes > 64:
                calls = max(calls, math.ceil(nbytes / DDP_BUCKET))
            t = collective_seconds(kind, nbytes, n, link, calls)
            total += t
            floor += t / calls  # one unit's (or bucket's): the first gather, the last reduce
        if dim in DATA_DIMS and total:
            window = compute if fsdp else BACKWARD_SHARE * micro
            out[dim] = out.get(dim, 0.0) + max(total - window, min(floor, total))
    _add(out, _comm_seconds(count, dev, deg, kinds=("broadcast", "all_to_all")))
    pp_p2p = count.bytes.get("point_to_point", {}).get("pp", 0)
    if pp_p2p:
        calls = count.calls["point_to_point"]["pp"]
        one = collective_seconds("point_to_point", pp_p2p / calls, 2,
                                 dim_link(dev, strides["pp"], deg.pipeline))
        # fill and drain: p - 1 sends each way on the critical path; the rest overlap.
        out["pp"] = out.get("pp", 0.0) + 2 * (deg.pipeline - 1) * one
    return out


def rank_time(r: Any, plan: Any, dev: Device) -> RankTime:
    """One simulated rank's compute, exposed communication and optimizer on `dev`."""
    deg, k = plan.degrees, plan.batch.k_steps
    c_micro = r.compute.seconds(dev) if r.compute is not None else 0.0
    tp = _comm_seconds(r.micro_comm, dev, deg)
    micro = c_micro + sum(tp.values())
    out = RankTime(rank=r.rank, compute=c_micro * k, micro=micro)
    _add(out.exposed, {dim: t * k for dim, t in tp.items()})
    _add(out.exposed, _data_exposed(r, dev, deg, c_micro * k, c_micro,
                                    fsdp=deg.fsdp_enabled))
    _add(out.exposed, _comm_seconds(r.step_comm, dev, deg))
    out.optimizer = r.optimizer_cost.seconds(dev) if r.optimizer_cost is not None else 0.0
    if r.compute is not None:
        out.flops = r.compute.flops * k
        out.forward_flops = r.compute.forward_flops * k
    return out


def _main_dtype(plan: Any) -> str:
    """The dtype most of the step's FLOPs run in (MFU's peak is that dtype's)."""
    flops: dict[str, float] = {}
    for r in plan.ranks:
        for dtype, f, *_ in (r.compute.matmuls if r.compute is not None else ()):
            flops[dtype] = flops.get(dtype, 0.0) + f
    return max(flops, key=flops.get) if flops else "float32"


def step_time(plan: Any, dev: Device) -> StepTime:
    """The predicted step of `plan` (a `LayoutPlan`) on `dev`."""
    deg = plan.degrees
    times = [rank_time(r, plan, dev) for r in plan.ranks]
    stages = deg.pipeline
    dtype = _main_dtype(plan)
    slow = max(times, key=lambda t: t.busy)
    bubble = 0.0
    if stages > 1:
        mean_micro = sum(t.micro for t in times) / len(times)
        bubble = (stages - 1) / plan.virtual * mean_micro
    # Ranks not simulated (a quick plan's middle stages) run like the first stage.
    per_stage = [t for t in times]
    missing = stages - len(times)
    flops = sum(t.flops for t in per_stage) + missing * times[0].flops
    forward = sum(t.forward_flops for t in per_stage) + missing * times[0].forward_flops
    replicas = plan.world // stages  # ranks per stage: data x tensor
    seconds = slow.busy + bubble
    return StepTime(device=dev.name, seconds=seconds, compute=slow.compute,
                    exposed=dict(slow.exposed), bubble=bubble, optimizer=slow.optimizer,
                    samples_per_step=plan.batch.global_batch_size,
                    tokens_per_sample=plan.tokens_per_sample, world=plan.world,
                    model_flops=3 * forward * replicas, hardware_flops=flops * replicas,
                    peak=dev.peak(dtype), dtype=dtype)
