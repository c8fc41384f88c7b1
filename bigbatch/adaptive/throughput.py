"""The step-time model of `bigbatch.adaptive.goodput` and its fit to measured step times.

``T(m, k, n) = (k - 1) T_grad + (T_grad^gamma + T_sync^gamma)^(1 / gamma)`` with
``T_grad = alpha_c + beta_c m`` and ``T_sync = alpha_n + beta_n (n - 2)`` for ``n >= 2`` (Pollux eq.
9-11); `bigbatch.adaptive.goodput`'s docstring says how the fit fixes what the samples cannot tell
apart. Everything public here is re-exported by `bigbatch.adaptive.goodput`.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bigbatch.errors import ConfigError

__all__ = ["ThroughputParams", "fit_throughput", "step_time"]

_GAMMA_MAX = 10.0
_GAMMA_GRID = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0)


@dataclass(frozen=True)
class ThroughputParams:
    """Parameters of the step-time model ``T(m, k, n)`` (seconds)."""

    alpha_c: float
    """Fixed time of one micro-step (kernel launches, per-step overhead)."""
    beta_c: float
    """Time per example of one micro-step."""
    alpha_n: float = 0.0
    """Time of one gradient sync on two workers."""
    beta_n: float = 0.0
    """Extra sync time per worker beyond two."""
    gamma: float = 1.0
    """Overlap of sync with the last backward pass: 1 none, large values full."""


def step_time(params: ThroughputParams, micro: Any, k: Any, world: Any) -> Any:
    """Seconds per optimizer step; broadcasts over numpy arrays of ``micro``, ``k``, ``world``."""
    m, k, n = (np.asarray(v, dtype=np.float64) for v in (micro, k, world))
    t_grad = params.alpha_c + params.beta_c * m
    # Pollux (and AdaptDL's _predict_network_time): alpha is the cost at two workers.
    t_sync = np.where(n > 1, params.alpha_n + params.beta_n * np.maximum(n - 2, 0.0), 0.0)
    top = np.maximum(np.maximum(t_grad, t_sync), 1e-300)
    g = params.gamma
    last = top * ((t_grad / top) ** g + (t_sync / top) ** g) ** (1.0 / g)
    out = (k - 1) * t_grad + last
    return float(out) if out.ndim == 0 else out


# ----------------------------------------------------------------------------- fitting


def _lm(residuals, x0: np.ndarray, iters: int = 200) -> tuple[np.ndarray, float]:
    """Levenberg-Marquardt with a forward-difference Jacobian; returns (x, cost)."""
    x = np.array(x0, dtype=np.float64)
    r = residuals(x)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(iters):
        if x.size == 0 or cost < 1e-30:
            break
        h = 1e-7 * np.maximum(1.0, np.abs(x))
        jac = np.stack(
            [(residuals(x + h[i] * np.eye(x.size)[i]) - r) / h[i] for i in range(x.size)], 1
        )
        a, grad = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e12:
            damp = lam * (np.diag(np.diag(a)) + 1e-12 * np.eye(x.size))
            try:
                step = np.linalg.solve(a + damp, -grad)
            except np.linalg.LinAlgError:
                lam *= 10.0
                continue
            r_new = residuals(x + step)
            c_new = float(r_new @ r_new)
            if np.isfinite(c_new) and c_new < cost:
                x, r, lam, improved = x + step, r_new, max(lam * 0.3, 1e-12), True
                done = cost - c_new <= 1e-14 * cost
                cost = c_new
                break
            lam *= 10.0
        if not improved or done:
            break
    return x, cost


def fit_throughput(
    samples: Sequence[tuple[int, int, int, float]], weights: Sequence[float] | None = None
) -> ThroughputParams:
    """Fit `ThroughputParams` to ``(micro, k_steps, world_size, seconds)`` samples.

    ``weights`` (e.g. how many steps each sample averages) scale the log residuals by their
    square root. Raises ConfigError without a sample or with a non-positive time.
    """
    if not samples:
        raise ConfigError("goodput: no step-time samples to fit; record some steps first")
    arr = np.asarray(samples, dtype=np.float64).reshape(-1, 4)
    m, k, n, t = arr.T
    if np.any(t <= 0) or np.any(arr[:, :3] < 1):
        raise ConfigError("goodput samples need micro, k_steps, world_size >= 1 and seconds > 0")
    w = np.sqrt(np.ones_like(t) if weights is None else np.asarray(weights, dtype=np.float64))
    log_t = np.log(t)
    multi = n > 1
    split_compute = len(np.unique(m)) == 1
    sync = "none" if not multi.any() else ("const" if len(np.unique(n[multi])) == 1 else "free")
    free_gamma = sync != "none" and len(np.unique(m[multi])) > 1
    m0 = float(m[0])

    def unpack(x: np.ndarray, gamma: float) -> ThroughputParams:
        e = np.exp(x)
        if split_compute:
            a_c, b_c, i = e[0] / 2.0, e[0] / (2.0 * m0), 1
        else:
            a_c, b_c, i = e[0], e[1], 2
        a_n = e[i] if sync != "none" else 0.0
        b_n = e[i + 1] if sync == "free" else 0.0
        return ThroughputParams(float(a_c), float(b_c), float(a_n), float(b_n), gamma)

    def resid(x: np.ndarray, gamma: float) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            pred = step_time(unpack(x, gamma), m, k, n)
            return w * (np.log(np.maximum(pred, 1e-300)) - log_t)

    # gamma = 1 is linear in the four times: least squares gives the starting point.
    cols = [k] if split_compute else [k, k * m]  # split: T_grad(m0) = t0, one column
    if sync != "none":
        cols.append(multi.astype(np.float64))
    if sync == "free":
        cols.append(np.where(multi, np.maximum(n - 2.0, 0.0), 0.0))
    design = np.stack(cols, 1) / t[:, None]  # relative error, like the log residuals
    lin, *_ = np.linalg.lstsq(design * w[:, None], w, rcond=None)
    floor = 1e-6 * float(np.median(t))
    x0 = np.log(np.maximum(lin, floor))

    best_x, best_cost, best_gamma = x0, math.inf, 1.0
    for gamma in _GAMMA_GRID if free_gamma else (1.0,):
        x, cost = _lm(lambda x, g=gamma: resid(x, g), x0)
        if cost < best_cost:
            best_x, best_cost, best_gamma = x, cost, gamma
    if free_gamma:
        # Joint refinement with gamma = 1 + (max - 1) * sigmoid(u) to stay in range.
        g0 = min(max(best_gamma, 1.001), _GAMMA_MAX - 0.001)
        u0 = math.log((g0 - 1.0) / (_GAMMA_MAX - g0))

        def gamma_of(u: float) -> float:
            return 1.0 + (_GAMMA_MAX - 1.0) / (1.0 + math.exp(-u))

        xj, cost = _lm(lambda z: resid(z[:-1], gamma_of(z[-1])), np.append(best_x, u0))
        if cost < best_cost:
            best_x, best_cost, best_gamma = xj[:-1], cost, gamma_of(xj[-1])
    return unpack(best_x, best_gamma)
