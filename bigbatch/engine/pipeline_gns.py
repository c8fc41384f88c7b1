"""The noise scale's two gradient norms in a pipeline-parallel step.

Small batch: the step's first micro-batch; big batch: the whole step (all
``accumulate_steps`` micro-batches, on every data rank). Each stage sees its own
parameters only, so each measures its part of both squared norms and one all-reduce of
three scalars over the pipeline group (small, big, the first micro-batch's item count,
known on the last stage) gives the whole model's.

The first micro-batch's gradient is what reaches a parameter first in a step:
torch's GPipe, 1F1B and interleaved 1F1B schedules run each stage's backwards in
micro-batch order, and the engine leaves every ``.grad`` None between steps. A
hook on each parameter (`Tensor.register_hook`, before accumulation) therefore
takes the squared norm of the incoming gradient when ``.grad`` is still None:
one 0-d tensor op per parameter per step, no copy, no host sync.

Pipeline x data (a data degree W above 1, no `[sharding]`): `bigbatch.engine.prepare`
wraps each stage in DDP over the data group (`PipelineRunner.replicate`). torch's stage
runs every backward but the step's last under `no_sync()`, so micro-batch 0's gradient
is this data rank's own when the hook sees it; DDP's reducer writes the step's averaged
gradient into ``.grad`` during the last backward, after the hooks of that backward, and
the big norm is read from ``.grad`` at the optimizer step, where the engine has
normalised it by the global item count exactly as on the FSDP2 path. Each data rank's
small norm, in units of its own micro-batch 0's mean item gradient, is one sample of a
micro-batch gradient's norm: the step reports their mean over the W data ranks (one
more all-reduce, of two scalars over the data group), with the mean of their item
counts as the small batch, as plain DDP reports its workers' norms.

A weight tied across stages (charlm's embedding and LM head) gets part of its
gradient on each holder. Its first micro-batch's gradient is the sum of those
parts, so each holder keeps a copy of its part, the copies are summed over the
holders' group (the holders in this data replica, the group that sums the step's
gradient), and only the first holder counts it, in both norms: one more all-reduce,
of the weight's size. The step then reads the item count on the host once, for the
estimator's batch sizes, as merged micro-steps with `count=` losses do.

Not covered (refused before launch, `bigbatch.config.parallelism`): `[sharding]`,
where FSDP2 accumulates the micro-batches in its own copies, so these hooks never
fire; tensor parallelism; PipeDream; a weight used by two stages of one rank.

Used by `bigbatch.engine.adaptive.attach` for `[pipeline]` runs; the norms go to
the tracker through `GradInfo` (`local_sq_norm`, `big_sq_norm`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bigbatch.engine.grad_info import GradInfo
from bigbatch.engine.local_norms import param_group_of, preconditioned_grads, tensor_sq_norms
from bigbatch.errors import ConfigError

__all__ = ["PipelineNorms", "check_measurable"]


def check_measurable(pipe: Any) -> None:
    """A ConfigError, on every rank, when a weight is used by two stages of one rank
    (interleaved): its first micro-batch's gradient arrives in two backwards."""
    if pipe.shared_across_chunks:
        raise ConfigError(
            f"[adaptive] with pipeline.virtual_stages={len(pipe.stage_ids)}: "
            f"the weight {pipe.shared_across_chunks[0]!r} is used by two stages of one "
            "rank, so its first micro-batch's gradient arrives in two backwards; split "
            "elsewhere (pipeline.split_points) or track no noise scale")


class PipelineNorms:
    """Collects, on each stage, micro-batch 0's and the step's squared gradient norms and
    sums them over the pipeline. `grad_info` builds the step's `GradInfo`.

    `preconditioned`: norms of ``g / (sqrt(v_hat) + eps)`` (AdamW, LAMB), as
    `bigbatch.engine.adaptive.Adaptive` measures them elsewhere.
    """

    def __init__(self, run: Any, preconditioned: bool) -> None:
        check_measurable(run.pipeline)
        pipe = run.pipeline
        self.preconditioned = preconditioned
        self._pipeline = pipe
        self._optimizer = run.optimizer
        self._params = run.params
        self._mesh = run.mesh
        self._scaler = run.scaler
        self._window = run.window
        self._groups = param_group_of(run.optimizer)
        device = run.world.device
        tied = {name: group for name, group in pipe.tied}
        named = dict(run.module.named_parameters())
        self._tied: list[tuple[torch.Tensor, Any, bool]] = []
        """(parameter, its holders' group, whether this rank counts it)."""
        self._first_tied: dict[int, torch.Tensor] = {}
        self._counted: list[torch.Tensor] = []
        self._slot: dict[int, int] = {}
        for name, p in named.items():
            if not p.requires_grad:
                continue
            if name in tied:
                group = tied[name]
                counts = name in pipe.tied_counted
                self._tied.append((p, group, counts))
                p.register_hook(self._keeper(p))
            else:
                self._slot[id(p)] = len(self._counted)
                self._counted.append(p)
                p.register_hook(self._measurer(p))
        self._first = torch.zeros(len(self._counted), dtype=torch.float64, device=device)

    def _measurer(self, p: torch.Tensor) -> Any:
        i = self._slot[id(p)]

        def hook(grad: torch.Tensor) -> None:
            if p.grad is None:  # the step's first backward through `p`: micro-batch 0
                self._first[i] = self._sq_norms([p], [grad]).sum()

        return hook

    def _keeper(self, p: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if p.grad is None:
                self._first_tied[id(p)] = grad.detach().clone()

        return hook

    def _sq_norms(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
        grads = [g.detach() for g in grads]
        if self.preconditioned:
            grads = preconditioned_grads(self._optimizer, params, grads, self._groups)
        return tensor_sq_norms(grads)

    def _local_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's (micro-batch 0, step) squared norms; the tied weights' counted once."""
        small = self._first.sum()
        self._first.zero_()  # a parameter with no gradient next step adds nothing
        params = [p for p in self._counted if p.grad is not None]
        params += [p for p, _, counts in self._tied if counts and p.grad is not None]
        big = (self._sq_norms(params, [p.grad for p in params]).sum() if params
               else torch.zeros((), dtype=torch.float64, device=small.device))
        first, self._first_tied = self._first_tied, {}
        for p, group, counts in self._tied:
            part = first.get(id(p))
            if part is None:
                part = torch.zeros_like(p)
            dist.all_reduce(part, group=group)
            if counts:
                small = small + self._sq_norms([p], [part]).sum()
        return small, big

    def grad_info(self, step: int, local_count: Any, total_count: Any) -> GradInfo:
        """Optimizer step `step`'s `GradInfo` (pipeline runs count items), with
        the whole model's norms, in the optimizer gradient's units: the mean gradient of
        micro-batch 0's items (the mean of the data ranks' squared norms) and of the step's
        (times k when ``avg = false``)."""
        mesh, window = self._mesh, self._window
        small, big = self._local_sums()
        count = self._pipeline.first_count.to(small.device, torch.float64)
        sums = torch.stack([small, big, count])
        dist.all_reduce(sums, group=mesh.pp_group)
        small, big, count = sums.unbind()
        scale = self._scaler.scale_value if self._scaler is not None else 1.0
        opt_factor = 1.0 if window.avg else float(window.k_steps)
        unit = scale * window.count_mult * count / opt_factor
        small = small / (unit * unit)
        data = mesh.data_degree
        if data > 1:  # every data rank measured its own micro-batch 0: their mean
            pair = torch.stack([small, count])
            dist.all_reduce(pair, group=mesh.dp_group)
            small, count = (pair / data).unbind()
        return GradInfo(step, self._params, small, float(count), float(total_count),
                        big_sq_norm=big)
