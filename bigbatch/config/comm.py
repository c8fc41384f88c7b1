"""How gradients and weights travel between workers: the reduce mode in force and the
local SGD section in force. What cannot go with them is in `bigbatch.config.compat`."""

from __future__ import annotations

from typing import Any

__all__ = ["LOSSY", "local_sgd_section", "reduce_mode"]

LOSSY = ("powersgd", "dgc")
"""Reduce modes whose result is not the mean up to rounding (fp16/bf16 only round it)."""


def reduce_mode(strategy: Any) -> str:
    """The reduce in force: ``"dgc"`` when `[dgc]` is on, else `data_parallel.reduce`."""
    return "dgc" if strategy.dgc.enable else strategy.data_parallel.reduce


def local_sgd_section(strategy: Any) -> Any:
    """`[localsgd]` or `[adaptive_localsgd]` when one is on, else None."""
    if strategy.localsgd.enable:
        return strategy.localsgd
    if strategy.adaptive_localsgd.enable:
        return strategy.adaptive_localsgd
    return None
