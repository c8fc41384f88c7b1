"""What a plan says: per-rank bytes, traffic per step, the bubble, the batch; as a dict
(`--json`) and as text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bigbatch.config.parallelism import Degrees
from bigbatch.planner.counting import ACTIVATION_METHOD, GIB, CommCount, wire_bytes

__all__ = ["GIB", "LayoutPlan", "RankPlan", "bubble"]

def bubble(stages: int, micro: int, virtual: int = 1) -> float:
    """The pipeline's idle fraction ``(p-1) / (v m + p - 1)`` (v = 1: ``(p-1)/(m+p-1)``)."""
    return (stages - 1) / (virtual * micro + stages - 1) if stages > 1 else 0.0


@dataclass
class RankPlan:
    """One simulated rank: the first rank of a pipeline stage (the ranks of a stage differ
    only by FSDP's uneven last shards, which the first rank never has)."""

    rank: int
    stages: list[int]
    params: int
    """Bytes of this rank's parameters (local shards; FSDP's padding included)."""
    grads: int
    """Bytes of its gradients at the optimizer step."""
    optimizer: int
    """Bytes of its optimizer state, as the optimizer's own step on meta created it (ZeRO-1:
    the fullest rank's partition)."""
    activations: int | None
    """Bytes kept for backward per micro-batch (None: no example input to measure)."""
    accumulated_grads: int = 0
    """Unsharded gradients FSDP keeps between the micro-batches of a step (ZeRO-2/3 with
    more than one micro-batch per step: gradient sync waits for the last one)."""
    buffers: int = 0
    """Transient copies: parameters FSDP gathers (ZeRO-3: the two largest units; ZeRO-2 and
    pipeline stages: all of them), DDP's gradient buckets."""
    in_flight: float = 1.0
    """Micro-batches whose activations are alive at once (the schedule's warmup)."""
    comm: CommCount = field(default_factory=CommCount)
    notes: list[str] = field(default_factory=list)
    offloaded: bool = False
    """`[sharding] offload`: sharded parameters, gradients and optimizer state live in host
    memory (the peak on the GPU leaves them out)."""
    compute: Any = None
    """Its operators for one micro-batch, forward and backward (`OpCost`; None without an
    example input)."""
    optimizer_cost: Any = None
    """The operators of its optimizer step (`OpCost`)."""
    micro_comm: CommCount = field(default_factory=CommCount)
    """Collectives inside one micro-batch's forward and backward (tensor parallelism)."""
    step_comm: CommCount = field(default_factory=CommCount)
    """Collectives of the optimizer step (norms, clipping, ZeRO-1's broadcasts)."""
    data_comm: CommCount = field(default_factory=CommCount)
    """The data-parallel reductions, pipeline sends, tied-weight sums and item count."""

    @property
    def peak(self) -> int:
        """Estimated peak on the GPU: state, the larger of the gradients, buffers, live
        activations (without the offloaded state)."""
        act = int((self.activations or 0) * self.in_flight)
        state = 0 if self.offloaded else self.params + self.optimizer + self.grads
        return state + max(0, self.accumulated_grads - (0 if self.offloaded else self.grads)) \
            + self.buffers + act

    def bytes_dict(self) -> dict[str, Any]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "accumulated_grads": self.accumulated_grads,
                "buffers": self.buffers, "peak": self.peak}


@dataclass
class LayoutPlan:
    """A run laid out for `world` ranks (see `bigbatch.planner.plan`)."""

    world: int
    degrees: Degrees
    batch: Any
    """The `BatchPlan` at the data degree: global = micro x accumulation x data."""
    parameters: int
    """Parameters of the whole model (each counted once)."""
    optimizer_name: str
    schedule: str | None
    virtual: int
    ranks: list[RankPlan]
    gpu_memory: float | None = None
    """GiB per GPU to check against (None: not asked)."""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    strategy: Any = None
    tokens_per_sample: int | None = None
    """Tokens in one sample when the input is token ids (a language model), else None."""

    def time(self, device: Any) -> Any:
        """The predicted step on `device` (`bigbatch.planner.timing.StepTime`)."""
        from bigbatch.planner.timing import step_time

        return step_time(self, device)

    @property
    def worst(self) -> RankPlan:
        """The simulated rank with the largest estimated peak."""
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def busiest(self) -> RankPlan:
        """The simulated rank that sends the most (ring model)."""
        return max(self.ranks, key=lambda r: wire_bytes(r.comm))

    @property
    def bubble(self) -> float:
        return bubble(self.degrees.pipeline, self.batch.k_steps, self.virtual)

    @property
    def fits(self) -> bool | None:
        if self.gpu_memory is None:
            return None
        return self.worst.peak <= self.gpu_memory * GIB

    @property
    def mesh(self) -> dict[str, int]:
        d = self.degrees
        return {"pp": d.pipeline, "dp_replicate": d.replicate, "dp_shard": d.shard,
                "tp": d.tensor}

    def to_dict(self) -> dict[str, Any]:
        d, b, worst, busy = self.degrees, self.batch, self.worst, self.busiest
        return {
            "world": self.world,
            "mesh": self.mesh,
            "layout": d.describe(),
            "zero_stage": d.stage,
            "parameters": self.parameters,
            "optimizer": self.optimizer_name,
            "per_rank_bytes": worst.bytes_dict(),
            "worst_rank": worst.rank,
            "activations_in_flight": worst.in_flight,
            "activation_method": ACTIVATION_METHOD,
            "comm_bytes_per_step": busy.comm.to_dict(),
            "comm_calls_per_step": {k: dict(sorted(v.items()))
                                    for k, v in busy.comm.calls.items()},
            "comm_sent_bytes_per_step": wire_bytes(busy.comm),
            "bubble": self.bubble,
            "schedule": self.schedule,
            "batch": {"global": b.global_batch_size, "micro": b.micro_batch_size,
                      "accumulation": b.k_steps, "data": b.world_size},
            "gpu_memory_gib": self.gpu_memory,
            "fits": self.fits,
            "stages": [{"rank": r.rank, "stages": r.stages, **r.bytes_dict(),
                        "in_flight": r.in_flight,
                        "comm_bytes_per_step": r.comm.to_dict()} for r in self.ranks],
            "notes": list(dict.fromkeys(self.notes + [n for r in self.ranks for n in r.notes])),
            "seconds": round(self.seconds, 2),
        }

    def summary(self) -> str:
        """The plan as text for a terminal (80 columns)."""
        from bigbatch.planner.report import render

        return render(self)
