"""numpy's random states as tensors and plain data, so a checkpoint that holds one is read
back weights-only (`bigbatch.engine.safe_load`): the global generator's (in every RNG
state bigbatch saves) and a `RandomState`'s (PowerSGD's)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["numpy_state", "numpy_tuple"]


def numpy_state(state: tuple) -> dict[str, Any]:
    """`RandomState.get_state()`'s tuple as a dict of a tensor and plain numbers."""
    kind, key, pos, has_gauss, gauss = state
    return {"kind": str(kind), "key": torch.from_numpy(np.asarray(key).astype(np.int64)),
            "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}


def numpy_tuple(state: Any) -> tuple:
    """What `RandomState.set_state()` takes, from `numpy_state`'s dict or from the tuple
    itself (states saved before they were plain data)."""
    if not isinstance(state, dict):
        return tuple(state)
    key = state["key"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    return (state["kind"], key.astype(np.uint32), int(state["pos"]), int(state["has_gauss"]),
            float(state["gauss"]))
