"""KungFu's noise-scale policy as a decision rule: double the global batch whenever the
gradient noise scale has grown by `growth` since the batch was last set.

The noise scale ``B_simple = tr(Sigma) / |G|^2`` is measured in samples: it is the
batch at which a step's gradient noise equals its signal (McCandlish et al. 2018),
and it grows as training proceeds and the gradient shrinks. KungFu's adaptive-batch
policy (Mai et al. 2020) follows it by doubling the batch each time it has doubled,
which keeps the batch a fixed fraction of the noise scale without ever shrinking it.
The batch never grows past ``max_batch_size``.

The engine's glue (reading the tracker, applying the change) is the built-in
policy ``noise_scale_doubling`` in `bigbatch.engine.policies`.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["NoiseScaleDoubler"]


class NoiseScaleDoubler:
    """`decide(noise_scale, global_batch)` -> the new global batch, or None to keep it."""

    def __init__(self, max_batch_size: int, growth: float = 2.0) -> None:
        self.max_batch_size = int(max_batch_size)
        self.growth = float(growth)
        self.reference: float | None = None
        """The noise scale when the batch was last set (None before the first estimate)."""

    def decide(self, noise_scale: float, global_batch: int) -> int | None:
        if not math.isfinite(noise_scale) or noise_scale <= 0:
            return None  # no signal yet: nothing to follow
        if self.reference is None:
            self.reference = float(noise_scale)
            return None
        if noise_scale < self.growth * self.reference or 2 * global_batch > self.max_batch_size:
            return None
        self.reference = float(noise_scale)
        return 2 * global_batch

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ref = state.get("reference")
        self.reference = None if ref is None else float(ref)
