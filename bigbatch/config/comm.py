"""How gradients and weights travel between workers: the reduce mode in force, local SGD,
the parameter server, and the settings that cannot go with them (one line each)."""

from __future__ import annotations

from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["LOSSY", "check_comm_combination", "local_sgd_section", "reduce_mode"]

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


def _switched_on_adaptive(strategy: Any) -> str | None:
    a = strategy.adaptive
    if a.noise_scale:
        return "adaptive.noise_scale=true"
    if a.lr != "none":
        return f'adaptive.lr="{a.lr}"'
    if a.batch_size != "fixed":
        return f'adaptive.batch_size="{a.batch_size}"'
    return None


def _meshed(strategy: Any) -> str | None:
    if strategy.sharding.enable:
        return "[sharding]"
    if strategy.tensor_parallel.tensor_parallel_degree > 1:
        return "tensor parallelism"
    if strategy.pipeline.enable:
        return "[pipeline]"
    return None


def check_comm_combination(strategy: Any) -> None:
    """Settings of the reduce, local SGD and parameter server that cannot go together."""
    dp = strategy.data_parallel
    if strategy.dgc.enable and dp.reduce not in ("mean", "dgc"):
        raise ConfigError(f'[dgc] with data_parallel.reduce="{dp.reduce}": DGC is a reduce of its '
                          'own; remove [dgc] or set data_parallel.reduce = "dgc"')
    mode = reduce_mode(strategy)
    adaptive = _switched_on_adaptive(strategy)
    if mode in LOSSY:
        _check_lossy(strategy, mode, adaptive)
    local = local_sgd_section(strategy)
    if strategy.localsgd.enable and strategy.adaptive_localsgd.enable:
        raise ConfigError("[localsgd] and [adaptive_localsgd] are both enabled; enable one")
    if local is not None:
        name = f"[{local.section}]"
        if mode != "mean":
            raise ConfigError(f'{name} with data_parallel.reduce="{mode}": local SGD averages '
                              'models, not gradients; use reduce = "mean"')
        if adaptive:
            raise ConfigError(f"{name} with {adaptive}: local steps have no all-reduced gradient "
                              "to measure; switch one off")
        if meshed := _meshed(strategy):
            raise ConfigError(f"{name} with {meshed} is not supported: local SGD averages whole "
                              "per-worker models (DDP); switch one off")
        if strategy.data_parallel.sync_batch_norm:
            raise ConfigError(f"{name} with data_parallel.sync_batch_norm: local steps do not "
                              "synchronise; switch one off")
    if strategy.parameter_server.enable:
        _check_parameter_server(strategy, mode, adaptive, local)


def _check_lossy(strategy: Any, mode: str, adaptive: str | None) -> None:
    key = f'data_parallel.reduce="{mode}"'
    if adaptive:
        raise ConfigError(f"{key} with {adaptive}: the noise scale needs the plain mean of the "
                          'workers\' gradients; use reduce = "mean", "fp16" or "bf16"')
    amp = strategy.amp
    if amp.enable and amp.dtype == "float16":
        raise ConfigError(f'{key} with amp.dtype="float16": its error feedback would keep an '
                          'overflowing (inf) loss-scaled gradient for good; use amp.dtype = '
                          '"bfloat16"')
    if mode == "dgc":
        o = strategy.optimizer
        if strategy.lars.enable or strategy.lamb.enable or o.type != "momentum":
            name = "[lars]" if strategy.lars.enable else "[lamb]" if strategy.lamb.enable \
                else f'optimizer.type="{o.type}"'
            raise ConfigError(f"{key} with {name}: DGC's momentum correction replaces the "
                              'optimizer\'s momentum; use optimizer.type = "momentum" without '
                              "[lars]/[lamb]")
        if o.nesterov:
            raise ConfigError(f"{key} with optimizer.nesterov=true: DGC's momentum correction "
                              "is plain momentum; set nesterov = false")


def _check_parameter_server(strategy: Any, mode: str, adaptive: str | None, local: Any) -> None:
    ps = strategy.parameter_server
    if meshed := _meshed(strategy):
        raise ConfigError(f"[parameter_server] with {meshed}: servers hold whole tensors for "
                          "whole-model workers; switch one off")
    if mode != "mean":
        raise ConfigError(f'[parameter_server] with data_parallel.reduce="{mode}": the servers '
                          'combine the gradients; use reduce = "mean"')
    if local is not None:
        raise ConfigError(f"[parameter_server] with [{local.section}]: switch one off")
    if adaptive:
        raise ConfigError(f"[parameter_server] with {adaptive} is not supported; switch one off")
    if strategy.amp.enable and strategy.amp.dtype == "float16":
        raise ConfigError('[parameter_server] with amp.dtype="float16": the servers keep no loss '
                          'scale; use amp.dtype = "bfloat16"')
    if strategy.data_parallel.sync_batch_norm:
        raise ConfigError("[parameter_server] with data_parallel.sync_batch_norm is not "
                          "supported; switch one off")
    if ps.servers > 1 and strategy.lamb.enable and strategy.lamb.max_grad_norm is not None:
        raise ConfigError(f"lamb.max_grad_norm with parameter_server.servers={ps.servers}: the "
                          "global norm spans shards on other servers; use servers = 1")
