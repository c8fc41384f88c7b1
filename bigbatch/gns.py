"""Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

With ``G`` the true gradient and ``Sigma`` the per-example gradient covariance, the mean
gradient of ``B`` independent examples satisfies ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``.
Squared norms measured at two batch sizes give two such equations, hence unbiased
estimates of both unknowns (appendix A.1)::

    |G|^2     = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

``B_simple = tr(Sigma) / |G|^2`` is the simple noise scale, the critical-batch estimate.
A ratio of unbiased estimates is biased and a single step's ratio is heavy-tailed, so the
tracker averages numerator and denominator separately and divides the averages, as the
paper recommends.

Where the two norms come from (the engine picks one; all give a `NormPair`):

- DDP: small = each worker's local gradient before the all-reduce, big = the all-reduced
  gradient. `local_sq_norm_hook` records the local norms inside DDP's comm hook and
  `ddp_sq_norms` all-reduces one float, so no gradient is copied or sent twice.
- One worker with gradient merge: small = the first micro-step, big = the merged gradient
  (`merge_sq_norms`).
- Neither: two consecutive steps (`ConsecutiveSteps`). Biased, because the parameters move
  between the two gradients; the tracker carries a `biased` flag so reports can say so.

For Adam/LAMB the noise scale that matters is that of the preconditioned gradient
``g / (sqrt(v_hat) + eps)``; `adam_sq_norm` measures it from the optimizer's ``exp_avg_sq``.
"""

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from bigbatch.errors import ConfigError

__all__ = [
    "ConsecutiveSteps",
    "GradientNoiseScale",
    "LocalSqNorm",
    "NoiseEstimate",
    "NormPair",
    "adam_sq_norm",
    "ddp_sq_norms",
    "estimate",
    "local_sq_norm_hook",
    "merge_sq_norms",
    "sq_norm",
]


@dataclass(frozen=True)
class NoiseEstimate:
    """Unbiased per-step estimates of the true gradient's squared norm and the noise."""

    sq_norm: float
    """Estimate of ``|G|^2``; may be negative when the noise dominates one step."""
    trace: float
    """Estimate of ``tr(Sigma)``, the per-example gradient variance summed over parameters."""

    @property
    def b_simple(self) -> float:
        """``tr(Sigma) / |G|^2`` of this one step (heavy-tailed; prefer the tracker's)."""
        return _ratio(self.trace, self.sq_norm)


class NormPair(NamedTuple):
    """Squared norms of mean gradients at two batch sizes: the input of `estimate`."""

    small_sq_norm: float
    big_sq_norm: float
    small_batch: int
    big_batch: int


def _ratio(trace: float, sq_norm: float) -> float:
    if math.isnan(trace) or math.isnan(sq_norm):
        return math.nan
    if sq_norm > 0:
        return max(trace, 0.0) / sq_norm
    # No detectable signal: the noise scale is beyond what the batch sizes can resolve.
    return math.inf if trace > 0 else math.nan


def estimate(
    small_sq_norm: float | torch.Tensor,
    big_sq_norm: float | torch.Tensor,
    small_batch: int,
    big_batch: int,
) -> NoiseEstimate:
    """Unbiased ``|G|^2`` and ``tr(Sigma)`` from ``|G_small|^2`` and ``|G_big|^2`` (eq. A.1).

    Both norms are of *mean* gradients over ``small_batch`` and ``big_batch`` examples.
    """
    if not 0 < small_batch < big_batch:
        raise ConfigError(
            f"gns batch sizes: small_batch={small_batch}, big_batch={big_batch}; "
            "need 0 < small_batch < big_batch"
        )
    small, big = float(small_sq_norm), float(big_sq_norm)
    b_s, b_b = float(small_batch), float(big_batch)
    g2 = (b_b * big - b_s * small) / (b_b - b_s)
    trace = (small - big) / (1.0 / b_s - 1.0 / b_b)
    return NoiseEstimate(sq_norm=g2, trace=trace)


class GradientNoiseScale:
    """Bias-corrected EMAs of ``|G|^2`` and ``tr(Sigma)``; ``b_simple`` is their ratio.

    ``update`` takes one step's norms (or ``update_estimate`` one `NoiseEstimate`). Before
    the first update every statistic is NaN. ``b_simple_stderr`` is a standard error from
    the spread of the recent per-step estimates (see its docstring for what it ignores).
    """

    def __init__(self, beta: float = 0.95, *, biased: bool = False, window: int = 100):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"gns_ema={beta} is out of range; allowed: 0 <= gns_ema < 1")
        if window < 2:
            raise ConfigError(f"gns window={window} is out of range; allowed: >= 2")
        self.beta = beta
        """EMA decay per update (``adaptive.gns_ema``)."""
        self.biased = biased
        """True when the inputs come from consecutive steps (parameters moved in between)."""
        self.window = window
        """How many recent per-step estimates ``b_simple_stderr`` looks at."""
        self.steps = 0
        """Number of updates so far."""
        self._ema_sq = 0.0
        self._ema_trace = 0.0
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)

    def update(
        self,
        small_sq_norm: float | torch.Tensor,
        big_sq_norm: float | torch.Tensor,
        small_batch: int,
        big_batch: int,
    ) -> NoiseEstimate:
        """Fold in one step measured at two batch sizes; returns that step's estimate."""
        est = estimate(small_sq_norm, big_sq_norm, small_batch, big_batch)
        self.update_estimate(est)
        return est

    def update_estimate(self, est: NoiseEstimate) -> None:
        """Fold in one step's `NoiseEstimate` (non-finite estimates are skipped)."""
        if not (math.isfinite(est.sq_norm) and math.isfinite(est.trace)):
            return
        b = self.beta
        self._ema_sq = b * self._ema_sq + (1.0 - b) * est.sq_norm
        self._ema_trace = b * self._ema_trace + (1.0 - b) * est.trace
        self.steps += 1
        self._recent.append((est.sq_norm, est.trace))

    def _correction(self) -> float:
        return 1.0 - self.beta**self.steps

    @property
    def sq_norm(self) -> float:
        """Bias-corrected EMA of ``|G|^2`` (AdaScale's ``mu^2``)."""
        return self._ema_sq / self._correction() if self.steps else math.nan

    @property
    def trace(self) -> float:
        """Bias-corrected EMA of ``tr(Sigma)`` (per-example variance)."""
        return self._ema_trace / self._correction() if self.steps else math.nan

    @property
    def b_simple(self) -> float:
        """``tr(Sigma) / |G|^2`` from the EMAs; ``inf`` when no signal is detected yet."""
        return _ratio(self.trace, self.sq_norm) if self.steps else math.nan

    @property
    def b_simple_stderr(self) -> float:
        """Standard error of ``b_simple`` from the last ``window`` per-step estimates.

        Linearised (delta-method) error of the weighted ratio ``sum w S / sum w G`` with the
        EMA's weights, the residual variance taken from the per-step residuals. It assumes
        the per-step estimates are independent and the noise scale did not drift within the
        window, so it measures sampling noise, not the bias of consecutive-step mode. NaN
        with fewer than 3 estimates or no signal.
        """
        n = len(self._recent)
        if n < 3:
            return math.nan
        w = torch.tensor([self.beta**age for age in range(n - 1, -1, -1)], dtype=torch.float64)
        g = torch.tensor([r[0] for r in self._recent], dtype=torch.float64)
        s = torch.tensor([r[1] for r in self._recent], dtype=torch.float64)
        den = float((w * g).sum())
        if den <= 0:
            return math.nan
        ratio = float((w * s).sum()) / den
        n_eff = float(w.sum() ** 2 / (w * w).sum())
        if n_eff <= 1.0:
            return math.nan
        var = float((w * w * (s - ratio * g) ** 2).sum()) / den**2 * n_eff / (n_eff - 1.0)
        return math.sqrt(var)

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "biased": self.biased,
            "window": self.window,
            "steps": self.steps,
            "ema_sq_norm": self._ema_sq,
            "ema_trace": self._ema_trace,
            "recent": [list(r) for r in self._recent],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])
        self.biased = bool(state["biased"])
        self.window = int(state["window"])
        self.steps = int(state["steps"])
        self._ema_sq = float(state["ema_sq_norm"])
        self._ema_trace = float(state["ema_trace"])
        self._recent = deque(((float(a), float(b)) for a, b in state["recent"]), self.window)

    def __repr__(self) -> str:
        return (
            f"GradientNoiseScale(b_simple={self.b_simple:.4g}, sq_norm={self.sq_norm:.4g}, "
            f"trace={self.trace:.4g}, steps={self.steps}, biased={self.biased})"
        )


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

    ``v`` is ``optimizer.state[p]["exp_avg_sq"]``, ``beta2`` from the group's ``betas`` and
    ``eps`` its ``eps``. Parameters with no state yet (before the first step) count
    unpreconditioned, as in AdaptDL. The preconditioner is the one the *next* update will
    divide by, up to that update's own contribution to ``v``.
    """
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    plain: list[torch.Tensor] = []
    gs: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    root_bc: list[Any] = []  # sqrt(1 - beta2^t): floats, or 0-d tensors for tensor steps
    epss: list[float] = []
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        state = optimizer.state.get(p, {})
        v = state.get("exp_avg_sq")
        group = group_of.get(id(p))
        if v is None or group is None:
            plain.append(g)
            continue
        gs.append(g if g.dtype == torch.float64 else g.float())  # keep float64 exact
        vs.append(v)
        epss.append(float(group.get("eps", 1e-8)))
        beta2 = float(group.get("betas", (0.9, 0.999))[1])
        step = state.get("step", 0) if group.get("bias_correction", True) else 0
        if isinstance(step, torch.Tensor):  # may live on the GPU: never read it on the host
            acc = torch.float64 if v.dtype == torch.float64 else torch.float32
            bc2 = 1.0 - torch.pow(beta2, step.to(v.device, acc))
            root_bc.append(torch.where(bc2 > 0, bc2.clamp_min(0).sqrt(), 1.0))
        else:
            root_bc.append(math.sqrt(1.0 - beta2**step) if step > 0 else 1.0)
    total = sq_norm(plain)
    if gs:
        if any(isinstance(r, torch.Tensor) for r in root_bc):
            root_bc = [
                torch.as_tensor(r, device=v.device) for r, v in zip(root_bc, vs, strict=True)
            ]
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, root_bc)
        torch._foreach_add_(denom, epss)
        pre = sq_norm(torch._foreach_div(gs, denom))
        total = total.to(pre.device) + pre
    return total


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
