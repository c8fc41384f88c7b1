"""Pollux's throughput model over the autoscaler's measured sizes: samples/s and goodput
predicted for each worker count (the ``model`` rule of `bigbatch.adaptive.autoscale`).

Each measured size gives one step-time sample ``(micro, k_steps, n, B / samples_per_s)``,
fitted by `bigbatch.adaptive.goodput`'s throughput fit (`fit_throughput`, the one
`GoodputTuner.fit` runs): ``T(m, k, n) = (k - 1) T_grad + (T_grad^g + T_sync^g)^(1/g)``,
``T_sync(n) = alpha_n + beta_n (n - 2)``. A size not measured is predicted at the batch a
segment would run there (``batch.elastic``'s split, given by the caller) and its goodput is
the predicted samples/s times Pollux's statistical efficiency of that batch at the latest
noise scale (1 without one).

The fit needs the growth of the sync with ``n``: it is `ready` once three sizes are
measured, two of them on more than one worker; before that it predicts nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bigbatch.adaptive.goodput import ThroughputParams, efficiency, fit_throughput, step_time

__all__ = ["Forecast", "fit_sizes", "forecast_size", "ready"]


@dataclass(frozen=True)
class Forecast:
    """What the model predicts for one worker count."""

    world_size: int
    global_batch_size: int
    micro_batch_size: int
    k_steps: int
    samples_per_s: float
    efficiency: float = 1.0

    @property
    def goodput(self) -> float:
        return self.samples_per_s * self.efficiency


def _usable(m: Any) -> bool:
    return (m.micro_batch_size > 0 and m.k_steps > 0 and m.global_batch_size > 0
            and math.isfinite(m.samples_per_s) and m.samples_per_s > 0)


def ready(measured: Iterable[Any]) -> bool:
    """Enough measured sizes (`Measurement`s with their batch split) to fit the sync's growth."""
    sizes = {m.world_size for m in measured if _usable(m)}
    return len(sizes) >= 3 and len([n for n in sizes if n > 1]) >= 2


def fit_sizes(measured: Iterable[Any]) -> ThroughputParams | None:
    """The throughput model fitted to the measured sizes (None until `ready`)."""
    rows = [m for m in measured if _usable(m)]
    if not ready(rows):
        return None
    return fit_throughput([(m.micro_batch_size, m.k_steps, m.world_size,
                            m.global_batch_size / m.samples_per_s) for m in rows])


def forecast_size(params: ThroughputParams, n: int, micro: int, k: int, noise_scale: float,
                  base_batch_size: int) -> Forecast:
    """Samples/s and efficiency at `n` workers running ``micro x k`` per worker."""
    batch = int(micro) * int(k) * int(n)
    sps = batch / step_time(params, micro, k, n)
    eff = 1.0
    if math.isfinite(noise_scale) and noise_scale > 0 and base_batch_size > 0:
        eff = float(efficiency(batch, noise_scale, base_batch_size))
    return Forecast(int(n), batch, int(micro), int(k), float(sps), eff)
