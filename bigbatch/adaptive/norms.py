"""Where the two squared norms of `bigbatch.adaptive.gns` come from: the collectors and `NormPair`.

Everything here is re-exported by `bigbatch.adaptive.gns`, whose docstring says which collector
fits which setup; this module holds the torch (and ``torch.distributed``) side, so the
estimators there stay pure arithmetic on floats.
"""

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "ConsecutiveSteps",
    "LocalSqNorm",
    "NormPair",
    "adam_sq_norm",
    "ddp_sq_norms",
    "local_sq_norm_hook",
    "merge_sq_norms",
    "param_group_of",
    "preconditioned_grads",
    "sq_norm",
]


class NormPair(NamedTuple):
    """Squared norms of mean gradients at two batch sizes: the input of `bigbatch.adaptive.gns.estimate`."""

    small_sq_norm: float
    big_sq_norm: float
    small_batch: int
    big_batch: int


# ----------------------------------------------------------------------------- norms


def sq_norm(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Sum of squared entries over a list of tensors, as a 0-d tensor.

    Accumulates in float32 (float64 for float64 inputs); one ``_foreach_norm`` per device; ``None`` entries (parameters without gradient) are
    skipped. The result stays on the device, so calling this does not synchronise.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None:
            acc = torch.float64 if t.dtype == torch.float64 else torch.float32
            groups.setdefault((t.device, acc), []).append(t)
    if not groups:
        return torch.zeros((), dtype=torch.float32)
    parts = []
    for (_, acc), ts in groups.items():
        norms = torch._foreach_norm(ts, 2, dtype=acc)
        parts.append(torch.stack(norms).square().sum())
    out_dtype = torch.promote_types(*(p.dtype for p in parts)) if len(parts) > 1 else parts[0].dtype
    first = parts[0].device
    return torch.stack([p.to(first, out_dtype) for p in parts]).sum()


def adam_sq_norm(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """``sum |g / (sqrt(v / (1 - beta2^t)) + eps)|^2``: the Adam/LAMB-preconditioned norm.

    The sum of `preconditioned_grads`' squares (see there which coordinates count).
    """
    return sq_norm(preconditioned_grads(optimizer, params, grads))


def preconditioned_grads(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                         grads: Sequence[torch.Tensor | None],
                         group_of: dict[int, dict[str, Any]] | None = None) -> list[torch.Tensor]:
    """``g / (sqrt(v_hat) + eps)`` per tensor: the gradient as Adam/LAMB's next update sees it.

    ``v`` is ``optimizer.state[p]["exp_avg_sq"]``, ``beta2`` from the group's ``betas`` and
    ``eps`` its ``eps``: the preconditioner the *next* update divides by, up to that
    update's own contribution to ``v``. Parameters with no state yet (before the first
    step) stay unpreconditioned, as in AdaptDL.

    Coordinates whose ``v`` is still exactly zero count as zero: they have never had a
    gradient (embedding rows of tokens not yet seen), so ``g / eps`` there measures eps,
    not the gradient's noise, and one such row in a worker's batch made per-step noise
    estimates of 1e13-1e15 that froze the noise scale's average. The same coordinates are
    dropped from the small and the big batch's norm, so the estimate stays consistent:
    it is the noise scale of the coordinates the optimizer has seen.

    New tensors in the order of `params` (None gradients skipped). A fixed number of
    (multi-tensor) ops whatever the parameter count, and no host sync. `group_of` (id of
    a parameter -> its param group; default: built from `optimizer`) saves rebuilding that
    map when called per parameter.
    """
    if group_of is None:
        group_of = param_group_of(optimizer)
    out: list[torch.Tensor | None] = []
    at, gs, vs, epss, betas, steps = [], [], [], [], [], []
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        g = g.detach()
        state, group = optimizer.state.get(p, {}), group_of.get(id(p))
        v = state.get("exp_avg_sq")
        if v is None or group is None:
            out.append(g)
            continue
        at.append(len(out))
        out.append(None)
        gs.append(g if g.dtype == torch.float64 else g.float())
        vs.append(v)
        epss.append(float(group.get("eps", 1e-8)))
        betas.append(float(group.get("betas", (0.9, 0.999))[1]))
        # Step 0 (or no bias correction) gives 1 - beta2^0 = 0: no correction below.
        steps.append(state.get("step", 0) if group.get("bias_correction", True) else 0)
    if not gs:
        return out  # type: ignore[return-value]
    device = vs[0].device
    if all(isinstance(t, torch.Tensor) for t in steps):  # may live on the GPU: never read them
        step = torch.stack([t.reshape(()) for t in steps]).to(device, torch.float64)
    else:  # host numbers: one asynchronous copy (a blocking one is a host sync on CUDA)
        step = torch.tensor([float(t) for t in steps], dtype=torch.float64).to(
            device, non_blocking=True)
    beta2 = torch.tensor(betas, dtype=torch.float64).to(device, non_blocking=True)
    bc2 = 1.0 - beta2 ** step
    roots = torch.where(bc2 > 0, bc2.clamp_min(0).sqrt(), 1.0)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, list(roots.unbind()))
    torch._foreach_add_(denom, epss)
    pre = torch._foreach_div(gs, denom)
    torch._foreach_mul_(pre, torch._foreach_sign(vs))  # v >= 0: 0 where v == 0, else 1
    for i, t in zip(at, pre, strict=True):
        out[i] = t
    return out  # type: ignore[return-value]


def param_group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """id of each parameter -> its param group."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def merge_sq_norms(
    first_sq_norm: float | torch.Tensor,
    merged_sq_norm: float | torch.Tensor,
    micro_batch: int,
    k_steps: int,
) -> NormPair:
    """One worker, gradient merge: the first micro-step's mean gradient vs the merged one.

    ``first_sq_norm`` is the squared norm of the *mean* gradient of the first micro-batch
    (with averaged merge the accumulated ``.grad`` then holds ``g_1 / k``: multiply its
    squared norm by ``k**2``). ``merged_sq_norm`` is that of the mean over all ``k`` micro-batches.
    """
    return NormPair(float(first_sq_norm), float(merged_sq_norm), micro_batch, micro_batch * k_steps)


class ConsecutiveSteps:
    """Biased fallback with no merge and one worker: pairs step ``t`` with step ``t - 1``.

    Keeps one copy of the previous gradients (local memory, nothing crosses the network).
    ``small`` is the mean of the two squared norms at ``batch``, ``big`` the squared norm of
    their average at ``2 * batch``. Use with ``GradientNoiseScale(biased=True)``.
    """

    def __init__(self) -> None:
        self._prev: list[torch.Tensor] | None = None
        self._prev_sq: torch.Tensor | None = None

    def __call__(self, grads: Sequence[torch.Tensor | None], batch: int) -> NormPair | None:
        """Feed this step's mean gradients; returns a pair from the second call on."""
        cur = [g.detach() for g in grads if g is not None]
        cur_sq = sq_norm(cur)
        pair = None
        if self._prev is not None and len(self._prev) == len(cur):
            big = sq_norm(torch._foreach_add(cur, self._prev)) / 4.0
            small = (cur_sq + self._prev_sq.to(cur_sq.device)) / 2.0
            pair = NormPair(float(small), float(big), batch, 2 * batch)
        if self._prev is None or len(self._prev) != len(cur):
            self._prev = [g.clone() for g in cur]
        else:
            torch._foreach_copy_(self._prev, cur)
        self._prev_sq = cur_sq
        return pair

    def reset(self) -> None:
        """Forget the stored gradients (after a batch-size change or a resume)."""
        self._prev = None
        self._prev_sq = None


# ----------------------------------------------------------------------------- DDP


class LocalSqNorm:
    """State of `local_sq_norm_hook`: sums this worker's pre-all-reduce squared norms.

    ``optimizer`` set: measure the Adam-preconditioned norm (`adam_sq_norm`). Call
    `pop` once per optimizer step, after backward, to read and reset the sum.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        self.process_group = process_group
        """Group the hook all-reduces over (None: the default group)."""
        self.optimizer = optimizer
        """Adam/LAMB optimizer whose ``exp_avg_sq`` preconditions the norm, or None."""
        self._sum: torch.Tensor | None = None

    def add(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Record local gradients (usable from any other comm hook, before it reduces)."""
        if self.optimizer is not None:
            s = adam_sq_norm(self.optimizer, params, grads)
        else:
            s = sq_norm(grads)
        self._sum = s if self._sum is None else self._sum + s.to(self._sum.device)

    def pop(self) -> torch.Tensor | None:
        """The local squared norm summed over buckets since the last pop (None: none seen)."""
        s, self._sum = self._sum, None
        return s


def local_sq_norm_hook(
    state: LocalSqNorm, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: record the local squared norm of the bucket, then mean all-reduce.

    Register with ``ddp_model.register_comm_hook(LocalSqNorm(...), local_sq_norm_hook)``.
    The reduction is exactly DDP's default (divide by world size, all-reduce).
    """
    state.add(bucket.parameters(), bucket.gradients())
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buf = bucket.buffer().div_(dist.get_world_size(group))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def ddp_sq_norms(
    local_sq_norm: float | torch.Tensor,
    global_sq_norm: float | torch.Tensor,
    local_batch: int,
    *,
    group: dist.ProcessGroup | None = None,
    sq_scale: float = 1.0,
) -> NormPair | None:
    """The DDP `NormPair`: workers' local gradients (small) vs the all-reduced one (big).

    ``local_sq_norm``: this worker's squared norm before the all-reduce (`LocalSqNorm.pop`);
    ``global_sq_norm``: that of the all-reduced mean gradient (the same on every worker);
    ``local_batch``: examples per worker per optimizer step (micro batch * k_steps). Both
    norms must be of *mean* gradients; ``sq_scale`` multiplies both (``1 / loss_scale**2``
    undoes AMP loss scaling). One all-reduce of one float averages the local norms over
    workers, so every worker returns the same pair. Returns None on a single worker.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world < 2:
        return None
    device = "cuda" if dist.get_backend(group) == dist.Backend.NCCL else "cpu"
    local = torch.as_tensor(local_sq_norm).to(device, torch.float64).reshape(1).clone()
    dist.all_reduce(local, group=group)
    small = float(local) / world * sq_scale
    big = float(global_sq_norm) * sq_scale
    return NormPair(small, big, local_batch, local_batch * world)
