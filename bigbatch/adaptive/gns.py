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

The collectors and `NormPair` live in `bigbatch.adaptive.norms` and are re-exported here.
"""

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.adaptive.norms import (
    ConsecutiveSteps,
    LocalSqNorm,
    NormPair,
    adam_sq_norm,
    ddp_sq_norms,
    local_sq_norm_hook,
    merge_sq_norms,
    sq_norm,
)
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


def _grads_of(source: Any) -> list[torch.Tensor]:
    """The gradients of a module's parameters, or the given tensors (None left out)."""
    if isinstance(source, torch.nn.Module):
        grads = [p.grad for p in source.parameters() if p.grad is not None]
    else:
        # A parameter stands for its gradient (parameters themselves are never gradients).
        grads = [t.grad if isinstance(t, torch.nn.Parameter) else t for t in source]
        grads = [g for g in grads if g is not None]
    if not grads:
        raise ValueError("GradientNoiseScale.update_from_grads: no gradients given "
                         "(call it after backward, before zero_grad)")
    return grads


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

    def update_from_grads(
        self,
        micro_grads: Any,
        merged_grads: Any,
        micro_batch: int,
        merged_batch: int,
    ) -> NoiseEstimate:
        """Fold in one step from any training loop, given two gradients of it.

        ``micro_grads``: the *mean* gradient of one micro-batch of ``micro_batch``
        examples; ``merged_grads``: the mean gradient of the step's whole batch of
        ``merged_batch`` examples (the merged micro-batches; with data parallelism, all
        ranks' after the all-reduce). Each is an ``nn.Module`` (its parameters' ``.grad``)
        or gradient tensors (a parameter stands for its ``.grad``); DTensors count whole
        (one all-reduce over their shards).

        Mean, not sum: a loop that divides each micro-batch's loss by the merge count
        ``k`` before ``backward`` (Hugging Face ``Trainer``, Accelerate's
        ``accumulate``) leaves ``g_1 / k`` in ``.grad`` after the first micro-batch: keep
        ``k`` times a copy of it as ``micro_grads``. A loop that sums per-token losses
        instead of averaging them must divide by the token count.
        """
        from bigbatch.optim._norms import global_norm

        small = global_norm(_grads_of(micro_grads)).double().square()
        big = global_norm(_grads_of(merged_grads)).double().square()
        return self.update(small, big, micro_batch, merged_batch)

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
