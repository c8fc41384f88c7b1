"""How gradients and weights travel between workers: the reduce mode in force and the
local SGD section in force. What cannot go with them is in `bigbatch.config.compat`."""

from __future__ import annotations

from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["LOSSY", "adasum_target", "check_pairwise_world", "local_sgd_section",
           "reduce_mode"]

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


def check_pairwise_world(strategy: Any, world_size: int) -> None:
    """`[localsgd] averaging = "pairwise"` pairs the workers on a hypercube: a ConfigError
    naming the key unless `world_size` is a power of two."""
    if not (strategy.localsgd.enable and strategy.localsgd.averaging == "pairwise"):
        return
    if world_size < 1 or world_size & (world_size - 1):
        low = 1 << (world_size.bit_length() - 1) if world_size > 1 else 1
        raise ConfigError(
            f'localsgd.averaging = "pairwise" pairs the workers on a hypercube and needs a '
            f"power-of-two number of them, got {world_size}; run {low} or {low * 2} "
            f'workers, or use averaging = "all"')


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
