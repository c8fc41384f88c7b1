"""The layout half of a Fleet strategy's translation (`bigbatch.config.fleet`):
`hybrid_configs`, `sharding`, `pipeline`, `tensor_parallel`, the parameter server's
`a_sync`, DGC and local SGD, and the switches that tune Paddle's runtime only.

Fleet's hybrid world is ``dp x mp x pp x sharding`` processes. bigbatch's mesh has
``pp x dp x tp`` with ZeRO sharding inside the data-parallel ranks, so Fleet's
``mp_degree`` is ``tensor_parallel.tensor_parallel_degree``, ``pp_degree`` is
``pipeline.pp_degree`` and its data-parallel ranks are ``dp_degree x sharding_degree``,
``sharding.sharding_degree`` of them sharing one replica's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bigbatch.config.fleet_record import FleetTranslation, refuse, take
from bigbatch.errors import ConfigError

__all__ = ["CONFIG_TABLES", "NO_EFFECT", "layout"]

HYBRID_KEYS = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
SHARDING_KEYS = {"sharding_degree": None, "stage": 1, "offload": False,
                 "optimize_offload": False, "segment_broadcast_MB": 32.0,
                 "sharding_segment_strategy": "segment_broadcast_MB", "segment_anchors": None,
                 "gradient_merge_acc_step": 1, "dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                 "hybrid_dp": False, "optimize_cast": False}
PIPELINE_KEYS = {"micro_batch_size": 1, "accumulate_steps": 1, "schedule_mode": "1F1B",
                 "p2p_cache_shape": True}
TP_KEYS = {"tensor_parallel_degree": 1, "tensor_init_seed": -1}
A_SYNC_KEYS = {"k_steps": -1, "send_queue_size": 16, "independent_recv_thread": False,
               "min_send_grad_num_before_recv": 1, "thread_pool_size": 1, "send_wait_times": 1,
               "runtime_split_send_recv": False, "launch_barrier": True}
DGC_KEYS = {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": [0.999]}
LOCALSGD_KEYS = {"k_steps": 1, "begin_step": 1}
ADAPTIVE_LOCALSGD_KEYS = {"init_k_steps": 1, "begin_step": 1}

CONFIG_TABLES = ("hybrid_configs", "sharding_configs", "pipeline_configs",
                 "tensor_parallel_configs", "a_sync_configs", "dgc_configs",
                 "localsgd_configs", "adaptive_localsgd_configs")

NO_EFFECT = {
    "fuse_all_reduce_ops": "torch's DDP buckets gradients itself",
    "fuse_grad_size_in_MB": None,  # translated: data_parallel.bucket_cap_mb
    "nccl_comm_num": "one NCCL communicator per process group",
    "sync_nccl_allreduce": "collectives are ordered on torch's stream",
    "use_hierarchical_allreduce": "NCCL picks its own algorithm",
    "cudnn_exhaustive_search": "a speed setting of Paddle's cuDNN calls",
    "cudnn_batchnorm_spatial_persistent": "a speed setting of Paddle's cuDNN calls",
    "conv_workspace_size_limit": "a speed setting of Paddle's cuDNN calls",
    "without_graph_optimization": "there is no static graph",
    "fuse_grad_merge": "a speed setting of Paddle's graph passes",
}
"""Fleet keys that change how fast Paddle runs, not what trains: shown as having no
effect here."""

SHARDING_NO_EFFECT = ("segment_broadcast_MB", "sharding_segment_strategy", "segment_anchors",
                      "hybrid_dp", "optimize_cast")
A_SYNC_TUNING = ("send_queue_size", "independent_recv_thread", "min_send_grad_num_before_recv",
                 "thread_pool_size", "send_wait_times", "runtime_split_send_recv",
                 "launch_barrier")


def layout(t: FleetTranslation, data: Mapping[str, Any], src: str) -> None:
    """Translate the layout keys of `data` into `t`; sets `t.world_size` from the degrees."""
    degrees = take(data.get("hybrid_configs", {}), "hybrid_configs", HYBRID_KEYS, src)
    given = set(data.get("hybrid_configs", {}))
    if data.get("sharding"):
        degrees = _sharding(t, data, degrees, given, src)
    for key, value in degrees.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{src}: hybrid_configs.{key} = {value!r}: an int >= 1")
    where = "hybrid_configs" if "hybrid_configs" in data else "sharding_configs"
    if degrees["mp_degree"] > 1 or data.get("tensor_parallel"):
        _tensor_parallel(t, data, degrees, where, src)
    if degrees["pp_degree"] > 1 or data.get("pipeline"):
        _pipeline(t, data, degrees, where, src)
    if degrees["sharding_degree"] > 1 and not data.get("sharding"):
        t.set(f"{where}.sharding_degree", "sharding.enable", True)
        t.set("(Fleet's sharding: stage 1)", "sharding.stage", 1)
        t.set(f"{where}.sharding_degree", "sharding.sharding_degree", degrees["sharding_degree"])
    if given or "hybrid_configs" in data or any(v > 1 for v in degrees.values()):
        t.world_size = (degrees["dp_degree"] * degrees["mp_degree"] * degrees["pp_degree"]
                        * degrees["sharding_degree"])
        t.note(f"{where} (world)", f"{t.world_size} processes = dp {degrees['dp_degree']} x "
               f"mp {degrees['mp_degree']} x pp {degrees['pp_degree']} x sharding "
               f"{degrees['sharding_degree']}")
    if data.get("a_sync"):
        _a_sync(t, data, src)
    elif "a_sync_configs" in data:
        t.note("a_sync_configs", "(not applied: a_sync is not true, as in Fleet)")
    _small(t, data, src)


def _sharding(t: FleetTranslation, data: Mapping[str, Any], degrees: dict[str, int],
              given: set[str], src: str) -> dict[str, int]:
    c = take(data.get("sharding_configs", {}), "sharding_configs", SHARDING_KEYS, src)
    written = set(data.get("sharding_configs", {}))
    if c["gradient_merge_acc_step"] != 1:
        raise refuse(src, "sharding_configs.gradient_merge_acc_step", "write it as "
                     "gradient_merge = true with gradient_merge_configs.k_steps")
    t.set("sharding", "sharding.enable", True)
    t.set("sharding_configs.stage" if "stage" in written else "(Fleet's sharding: stage 1)",
          "sharding.stage", int(c["stage"]))
    if c["offload"] or c["optimize_offload"]:
        key = "offload" if c["offload"] else "optimize_offload"
        t.set(f"sharding_configs.{key}", "sharding.offload", True)
    for key in SHARDING_NO_EFFECT:
        if key in written:
            t.note(f"sharding_configs.{key}", "(no effect: FSDP2/ZeRO place the state)")
    degrees = dict(degrees)
    for key in ("dp_degree", "mp_degree", "pp_degree"):
        if key in written and key not in given:
            degrees[key] = c[key]
    if c["sharding_degree"] is not None:
        degrees["sharding_degree"] = c["sharding_degree"]
    if degrees["sharding_degree"] > 1:
        t.set("sharding_configs.sharding_degree", "sharding.sharding_degree",
              degrees["sharding_degree"])
    return degrees


def _tensor_parallel(t: FleetTranslation, data: Mapping[str, Any], degrees: dict[str, int],
                     where: str, src: str) -> None:
    c = take(data.get("tensor_parallel_configs", {}), "tensor_parallel_configs", TP_KEYS, src)
    degree = degrees["mp_degree"]
    if "tensor_parallel_degree" in data.get("tensor_parallel_configs", {}):
        if degree > 1 and degree != c["tensor_parallel_degree"]:
            raise ConfigError(f"{src}: tensor_parallel_configs.tensor_parallel_degree="
                              f"{c['tensor_parallel_degree']} but {where}.mp_degree={degree}")
        degree = degrees["mp_degree"] = int(c["tensor_parallel_degree"])
        t.set("tensor_parallel_configs.tensor_parallel_degree",
              "tensor_parallel.tensor_parallel_degree", degree)
    else:
        t.set(f"{where}.mp_degree", "tensor_parallel.tensor_parallel_degree", degree)
    seed = c["tensor_init_seed"]
    if seed != -1:  # Fleet's -1: not set
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"{src}: tensor_parallel_configs.tensor_init_seed = {seed!r}: "
                              "an int >= 0, or -1 for the run's --seed")
        t.set("tensor_parallel_configs.tensor_init_seed", "tensor_parallel.tensor_init_seed",
              seed)


def _pipeline(t: FleetTranslation, data: Mapping[str, Any], degrees: dict[str, int],
              where: str, src: str) -> None:
    c = take(data.get("pipeline_configs", {}), "pipeline_configs", PIPELINE_KEYS, src)
    mode = {"F-then-B": "GPipe", "FThenB": "GPipe"}.get(c["schedule_mode"], c["schedule_mode"])
    if mode not in ("GPipe", "1F1B"):
        raise ConfigError(f"{src}: pipeline_configs.schedule_mode={c['schedule_mode']!r}: "
                          "Fleet's modes are \"1F1B\" and \"F-then-B\" (GPipe)")
    if degrees["pp_degree"] < 2:
        raise ConfigError(f"{src}: pipeline = true needs {where}.pp_degree >= 2 (the stages), "
                          f"got {degrees['pp_degree']}")
    t.set("pipeline", "pipeline.enable", True)
    t.set(f"{where}.pp_degree", "pipeline.pp_degree", degrees["pp_degree"])
    t.set("pipeline_configs.schedule_mode", "pipeline.schedule_mode", mode)
    t.set("pipeline_configs.micro_batch_size", "pipeline.micro_batch_size",
          int(c["micro_batch_size"]))
    t.set("pipeline_configs.accumulate_steps", "pipeline.accumulate_steps",
          int(c["accumulate_steps"]))
    if "p2p_cache_shape" in data.get("pipeline_configs", {}):
        t.note("pipeline_configs.p2p_cache_shape", "(no effect: shapes are sent once)")


def _a_sync(t: FleetTranslation, data: Mapping[str, Any], src: str) -> None:
    c = take(data.get("a_sync_configs", {}), "a_sync_configs", A_SYNC_KEYS, src)
    k = c["k_steps"]
    if isinstance(k, bool) or not isinstance(k, int) or k < -1:
        raise ConfigError(f"{src}: a_sync_configs.k_steps = {k!r}: an int; 0 (or -1, "
                          "Fleet's default) runs async, k > 0 runs GEO with k local steps")
    t.set("a_sync", "parameter_server.enable", True)
    given = "a_sync_configs.k_steps" if "k_steps" in data.get("a_sync_configs", {}) else "a_sync"
    if k > 0:  # GEO-SGD: k local steps, then the deltas added on the servers
        t.set(given, "parameter_server.mode", "geo")
        t.set(given, "parameter_server.geo_k_steps", k)
    else:
        t.set(given, "parameter_server.mode", "async")
    for key in A_SYNC_TUNING:
        if key in data.get("a_sync_configs", {}):
            t.note(f"a_sync_configs.{key}", "(no effect: Paddle's PS runtime tuning)")


def _small(t: FleetTranslation, data: Mapping[str, Any], src: str) -> None:
    """DGC, local SGD, synchronized BatchNorm and the runtime switches."""
    for switch, keys in (("dgc", DGC_KEYS), ("localsgd", LOCALSGD_KEYS),
                         ("adaptive_localsgd", ADAPTIVE_LOCALSGD_KEYS)):
        if not data.get(switch):
            continue
        c = take(data.get(f"{switch}_configs", {}), f"{switch}_configs", keys, src)
        t.set(switch, f"{switch}.enable", True)
        for key in keys:
            value = list(c[key]) if isinstance(c[key], list) else c[key]
            t.set(f"{switch}_configs.{key}", f"{switch}.{key}", value)
    for switch in ("sync_batch_norm", "find_unused_parameters"):
        if switch in data:
            t.set(switch, f"data_parallel.{switch}", bool(data[switch]))
    for key, why in NO_EFFECT.items():
        if key not in data:
            continue
        if key == "fuse_grad_size_in_MB":
            t.set(key, "data_parallel.bucket_cap_mb", float(data[key]))
        else:
            t.note(key, f"(no effect: {why})")
