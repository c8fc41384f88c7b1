"""Running a pipeline: this rank's stages on torch.distributed.pipelining's schedules.

`PipelineRunner` prunes the model to this rank's stage(s) (`bigbatch.parallel.pipeline`),
builds torch's `PipelineStage`s on the mesh's pipeline group and one of its
schedules (Huang et al. 2019, GPipe; Narayanan et al. 2019, 1F1B; Narayanan et
al. 2021, interleaved 1F1B), and runs one optimizer step's micro-batches through
it. The micro-batches are the step's gradient merge: the loss of each is a sum
over its items, and the engine divides the accumulated gradient by the global
item count, exactly as for merged micro-steps on one worker. Gradients of
weights tied across stages are summed between the ranks that hold them. With a data
degree above 1 the stages are FSDP2 modules (`bigbatch.parallel.sharding`), or DDP
modules over the data group (`replicate`) where the noise scale needs each
micro-batch's gradient in ``.grad``.

Evaluation runs forward only, through separate stages (torch's stages fix their
buffers' shapes at the first step) in batches of one fixed size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.optim._norms import global_norm
from bigbatch.parallel.mesh import ParallelMesh
from bigbatch.parallel.pipeline import (
    Chunk,
    Layer,
    prune_to_stage,
    split_layers,
    tied_parameters,
)

__all__ = ["PipelineRunner"]

LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class PipelineRunner:
    """This rank's part of the pipeline: its stage module(s), schedule and tied weights."""

    def __init__(self, model: nn.Module, layers: Sequence[Layer], mesh: ParallelMesh,
                 config: Any) -> None:
        self.mesh, self.config = mesh, config
        pp, v = mesh.degrees.pipeline, config.virtual_stages
        self.num_stages = pp * v
        ranges = split_layers(model, layers, self.num_stages, config.split_points)
        ties = tied_parameters(model, layers, ranges)
        r = mesh.pipeline_rank
        self.stage_ids = [r + j * pp for j in range(v)]
        """Indices of this rank's stages (one; or `virtual_stages`, pp apart)."""
        self.layer_names = [[layers[i].name for i in ranges[s]] for s in self.stage_ids]
        owned = [i for s in self.stage_ids for i in ranges[s]]
        self.module = prune_to_stage(model, layers, owned)
        """The model pruned to this rank's layers (parameter names unchanged)."""
        self._chunks: list[nn.Module] = (
            [self.module] if v == 1 else
            [Chunk(self.module, [layers[i] for i in ranges[s]], hold=True)
             for s in self.stage_ids])
        self._train_chunks = self._chunks
        """What the training schedule runs: `_chunks`, or DDP around each (`replicate`)."""
        self.is_first = 0 in self.stage_ids
        self.is_last = self.num_stages - 1 in self.stage_ids
        self.tied_counted: set[str] = set()
        """Names in `tied` whose first holder is this rank: a whole-model sum over stages
        (a gradient norm) counts a tied weight there only."""
        self.tied = self._tie_groups(ties)
        """(name in `module`, process group of its holders) of this rank's weights tied to
        other ranks' stages; their gradients are summed over the group after backward."""
        self.shared_across_chunks = [name for name, _, stages in ties
                                     if len({s % pp for s in stages}) < len(stages)]
        """Names of parameters used by two stages of one rank (interleaved; the same on
        every rank): each micro-batch's gradient reaches them in several backwards."""
        self.first_count: torch.Tensor = torch.zeros((), dtype=torch.float64)
        """Item count of the latest step's first micro-batch where this rank `reports`
        (zero elsewhere): the small batch of the noise scale."""
        self._loss: LossFn | None = None
        self._schedule: Any = None
        self._eval: Any = None
        self._eval_size = 0

    @property
    def reports(self) -> bool:
        """Whether this rank's losses and metrics count: the last stage's first tensor rank
        (its tensor peers compute the same numbers)."""
        return self.is_last and self.mesh.tensor_rank == 0

    def fsdp_units(self) -> list[nn.Module]:
        """Modules for FSDP2 to shard one by one: every submodule a kept layer calls."""
        units = []
        for module in self.module.children():
            if isinstance(module, (nn.Sequential, nn.ModuleList)):
                units += [m for m in module if next(m.parameters(), None) is not None]
            elif next(module.parameters(), None) is not None:
                units.append(module)
        return units

    def _tie_groups(self, ties) -> list[tuple[str, Any]]:
        """One process group per tied weight and (data, tensor) place, joining the pipeline
        ranks that hold it; every rank creates every group, in the same order. Returns this
        rank's (parameter name in `module`, group): by name, as sharding or slicing will
        replace the Parameter objects."""
        pp, d = self.mesh.degrees.pipeline, self.mesh.degrees
        local = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=False)}
        mine = []
        for _name, param, stages in ties:
            holders = sorted({s % pp for s in stages})
            if len(holders) < 2:
                continue
            for data_rank in range(d.data):
                for tensor_rank in range(d.tensor):
                    ranks = [(h * d.data + data_rank) * d.tensor + tensor_rank for h in holders]
                    group = dist.new_group(ranks)
                    if self.mesh.world.rank in ranks:
                        mine.append((local[id(param)], group))
                        if self.mesh.world.rank == ranks[0]:
                            self.tied_counted.add(local[id(param)])
        return mine

    def replicate(self, device: torch.device, bucket_cap_mb: float = 25.0) -> None:
        """Data parallelism of the stages by `DistributedDataParallel` over the mesh's data
        group, one DDP per stage (call before `start`). torch's stages run every backward
        but a step's last under `no_sync()`, so each micro-batch's local gradient reaches
        the parameters (`.grad` and tensor hooks), and the last backward all-reduces
        (averages) the step's sum over the data ranks. `module` stays the plain stage: its
        state dict and checkpoints keep their names. Evaluation runs the plain stages."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Buffers are not broadcast at each forward (FSDP2's stages do not either): that
        # would be a collective per micro-batch.
        self._train_chunks = [
            DDP(chunk, device_ids=[device.index] if device.type == "cuda" else None,
                process_group=self.mesh.dp_group, forward_sync_buffers=False,
                bucket_cap_mb=bucket_cap_mb)
            for chunk in self._chunks]

    def close(self) -> None:
        """Drop the schedules and DDP wrappers: a DDP reducer must go before its process group."""
        self._schedule = self._eval = None
        self._train_chunks = self._chunks

    @property
    def asynchronous(self) -> bool:
        """PipeDream: the stages update per micro-batch themselves (no engine step)."""
        return self.config.schedule_mode == "PipeDream"

    def counted_elsewhere(self) -> set[int]:
        """ids of this rank's parameters that a whole-model count takes on another rank:
        weights tied across stages count on their first holder only."""
        others = {name for name, _ in self.tied} - self.tied_counted
        return {id(p) for name, p in self.module.named_parameters() if name in others}

    def grad_sq_norm(self) -> torch.Tensor:
        """|g|^2 of the whole model's gradient, as a 0-d tensor (no host sync): this rank's
        stages (sharded gradients taken whole), summed over the pipeline in one all-reduce;
        a weight tied across stages counts on its first holder only. For clipping and the
        logged grad norm."""
        others = {name for name, _ in self.tied} - self.tied_counted
        grads = [p.grad for name, p in self.module.named_parameters()
                 if p.grad is not None and name not in others]
        if grads:
            sq = global_norm(grads).square()
        else:
            sq = torch.zeros((), device=next(self.module.parameters()).device)
        dist.all_reduce(sq, group=self.mesh.pp_group)
        return sq

    def settle(self) -> None:
        """Finish what is in flight (PipeDream carries micro-batches across steps), so the
        weights are those of every update taken: before saving, evaluating, stopping."""
        if self.asynchronous:
            self._schedule.drain()

    def start(self, device: torch.device, n_microbatches: int,
              optimizer: torch.optim.Optimizer | None = None) -> None:
        """Build the schedules, once the stage module is in its final (sharded) form.
        PipeDream steps `optimizer` itself, after every micro-batch's backward."""
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        group = self.mesh.pp_group

        def stages(chunks: list[nn.Module]) -> list[Any]:
            return [PipelineStage(chunk, s, self.num_stages, device, group=group)
                    for chunk, s in zip(chunks, self.stage_ids, strict=True)]

        mode = self.config.schedule_mode
        if mode == "PipeDream":
            from bigbatch.parallel.pipedream import PipeDream

            self._schedule = PipeDream(
                self.module, self.stage_ids[0], self.num_stages, group=group,
                make_optimizer=lambda params: optimizer,
                loss_fn=self._call_loss if self.is_last else None,
                vertical_sync=self.config.vertical_sync, device=device)
            self._micro = n_microbatches
        elif mode == "Interleaved1F1B":
            train = stages(self._train_chunks)
            self._schedule = ScheduleInterleaved1F1B(train, n_microbatches, loss_fn=self._call_loss,
                                                     scale_grads=False)
        else:
            train = stages(self._train_chunks)
            cls = ScheduleGPipe if mode == "GPipe" else Schedule1F1B
            self._schedule = cls(train[0], n_microbatches, loss_fn=self._call_loss,
                                 scale_grads=False)
        held = stages(self._chunks)
        self._eval = (ScheduleGPipe(held[0], 1) if len(held) == 1 else
                      ScheduleLoopedBFS(held, 1))

    def _call_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(output, target)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, loss: LossFn,
             mult: float, scale: Callable[[torch.Tensor], torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one optimizer step's micro-batches (`inputs` on the
        first stage, `targets` on the last; split in `n_microbatches` along dim 0).

        `loss(output, target) -> (sum, count)`; each micro-batch backpropagates
        ``sum x mult`` (then `scale`d: fp16), or under PipeDream its own mean, with the
        stage's update right after. Returns this rank's (loss sum, item count), zero where
        it does not `report`; tied weights' gradients are summed on return.
        """
        parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def micro_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            total, count = loss(output, target)
            count = torch.as_tensor(count, dtype=torch.float64)
            scaled = total / count.to(total.device) if self.asynchronous else total * mult
            scaled = scale(scaled) if scale is not None else scaled
            # Keyed by the tensor the schedule keeps: torch also calls the loss once to infer
            # gradient shapes at the first step, and that call must not count.
            parts[id(scaled)] = (total.detach().double(), count)
            return scaled

        self._loss = micro_loss
        used: list[torch.Tensor] = []
        held = contextlib.ExitStack()
        if self._train_chunks is not self._chunks:
            # DDP stages: torch's stage reduces at the last backward by calling the reducer
            # itself, and wraps the other forwards and backwards in `no_sync()`, but not the
            # forward and backward by which the first step infers shapes; outside `no_sync()`
            # that forward arms the reducer, which then reduces micro-batch 0.
            for chunk in self._train_chunks:
                held.enter_context(chunk.no_sync())
        try:
            self._run_schedule(inputs, targets, used)
        except Exception as e:
            from bigbatch.parallel.pipeline_failure import raise_together

            raise_together(e, self.stage_ids[0], self.num_stages,
                           peers=self.mesh.degrees.pipeline - 1)
        finally:
            self._loss = None
            held.close()
        for name, group in self.tied:
            grad = self.module.get_parameter(name).grad
            if grad is not None:
                dist.all_reduce(_local(grad), group=group)
        chosen = list(parts.values()) if self.asynchronous else [parts[id(x)] for x in used]
        if not self.reports or not chosen:
            zero = torch.zeros((), dtype=torch.float64)
            self.first_count = zero.clone()
            return zero, zero.clone()
        sums, counts = zip(*chosen, strict=True)
        self.first_count = counts[0]  # the schedules' losses come in micro-batch order
        return torch.stack(sums).sum(), torch.stack(counts).sum()

    def _run_schedule(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                      used: list[torch.Tensor]) -> None:
        if self.asynchronous:  # its losses come detached; every call is a real one
            self._schedule.step(inputs if self.is_first else None,
                                targets if self.is_last else None,
                                n_microbatches=self._micro)
        elif self.is_first:
            if self.is_last:
                self._schedule.step(inputs, target=targets, losses=used)
            else:
                self._schedule.step(inputs)
        elif self.is_last:
            self._schedule.step(target=targets, losses=used)
        else:
            self._schedule.step()

    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """The model's output for `inputs` (given on the first stage), on the last stage;
        None elsewhere. Every rank of the pipeline calls it together, always with batches
        of the size of its first call."""
        size = int(inputs.shape[0]) if inputs is not None else None
        if size is not None:
            if self._eval_size and size != self._eval_size:
                raise ValueError(f"forward_only: batch of {size}, the stages are built for "
                                 f"{self._eval_size}")
            self._eval_size = size
        out = self._eval.eval(inputs) if self.is_first else self._eval.eval()
        return out if self.is_last else None
