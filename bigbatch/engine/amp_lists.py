"""Fleet's `amp_configs.custom_white_list` / `custom_black_list` on torch's autocast.

autocast decides per op which dtype it runs in (its own lists). Fleet lets a user move
ops: the white list runs in the low dtype, the black list in float32. Here a
`TorchFunctionMode` sees each torch function call before autocast does; a listed op runs
with autocast off and its floating-point tensor arguments cast to the listed dtype, so
the op and its backward compute in that dtype. Ops are named as torch functions
(``F.softmax`` and ``Tensor.softmax`` are both "softmax"); Paddle's op names for the
same ops are accepted (`PADDLE_NAMES`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PADDLE_NAMES", "AmpOpLists", "amp_context", "op_name"]

PADDLE_NAMES = {
    "matmul_v2": "matmul", "mul": "linear", "fc": "linear", "elementwise_add": "add",
    "elementwise_mul": "mul", "elementwise_sub": "sub", "elementwise_div": "div",
    "reduce_sum": "sum", "reduce_mean": "mean", "lookup_table": "embedding",
    "lookup_table_v2": "embedding", "softmax_with_cross_entropy": "cross_entropy",
    "batch_norm": "batch_norm", "layer_norm": "layer_norm", "conv2d": "conv2d",
    "pool2d": "max_pool2d", "relu": "relu", "gelu": "gelu", "softmax": "softmax",
    "tanh": "tanh", "sigmoid": "sigmoid", "exp": "exp", "log": "log", "square": "square",
}
"""Paddle op names -> the torch function names they run as."""


def op_name(func: Any) -> str:
    """The name a list entry matches: a torch function's or a Tensor method's name,
    without a trailing in-place underscore."""
    name = getattr(func, "__name__", "") or ""
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, list | tuple):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):  # keyword arguments (F.layer_norm passes weight= so)
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


class AmpOpLists(TorchFunctionMode):
    """Run the white-listed ops in `low` and the black-listed ones in float32, with
    autocast off around them (`device_type`: autocast's device)."""

    def __init__(self, device_type: str, low: torch.dtype, white: Sequence[str] = (),
                 black: Sequence[str] = ()) -> None:
        super().__init__()
        self.device_type = device_type
        self.dtypes = {PADDLE_NAMES.get(n, n): low for n in white}
        self.dtypes.update({PADDLE_NAMES.get(n, n): torch.float32 for n in black})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.dtypes.get(op_name(func))
        if dtype is None or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        with torch.autocast(self.device_type, enabled=False):
            return func(*_cast(args, dtype), **_cast(kwargs, dtype))


def amp_context(device_type: str, dtype: torch.dtype, white: Sequence[str] = (),
                black: Sequence[str] = ()) -> contextlib.AbstractContextManager:
    """autocast at `dtype`, with the custom lists' exceptions when there are any."""
    if not white and not black:
        return torch.autocast(device_type, dtype=dtype)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type, dtype=dtype))
    stack.enter_context(AmpOpLists(device_type, dtype, white, black))
    return stack
