"""How gradients and weights travel between workers: the reduce mode in force and the
local SGD section in force. What cannot go with them is in `bigbatch.config.compat`."""

from __future__ import annotations

from typing import Any

__all__ = ["LOSSY", "adasum_target", "local_sgd_section", "reduce_mode"]

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


def adasum_target(strategy: Any) -> str | None:
    """What Adasum combines: "delta" (the optimizer's weight change, Horovod's Adasum
    optimizer), "gradient", or None when the reduce is not Adasum. ``adasum_on = "auto"``:
    delta for optimizer.type = "adamw" (AdamW, LAMB), gradient for "momentum" (SGD, LARS)."""
    dp = strategy.data_parallel
    if reduce_mode(strategy) != "adasum":
        return None
    if dp.adasum_on != "auto":
        return dp.adasum_on
    return "delta" if strategy.optimizer.type == "adamw" else "gradient"
