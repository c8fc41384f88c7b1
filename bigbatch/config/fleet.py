"""A Fleet `DistributedStrategy`, written with Fleet's names, as a bigbatch Strategy that
trains as Fleet trains it (`bigbatch train --fleet FILE`).

The file mirrors a Fleet script: the strategy's switches at the top (``lars = true``),
their ``*_configs`` tables, the inner optimizer in ``[optimizer]`` (Paddle's class name
and arguments) and the per-card ``batch_size`` of the script's DataLoader::

    task = "mnist1d"            # bigbatch's built-in task (not a Fleet key)
    batch_size = 32             # per card, per step: the script's DataLoader
    lars = true

    [lars_configs]
    lars_coeff = 0.001
    lars_weight_decay = 0.0005
    exclude_from_weight_decay = ["batch_norm", ".b_0"]

    [optimizer]
    type = "Momentum"
    learning_rate = 0.1
    momentum = 0.9

`translate` returns the Strategy and the rows ``Fleet key -> bigbatch key = value`` the
run prints. Where bigbatch's defaults differ from Fleet's the translation writes Fleet's
(no LR scaling, a constant LR, heavy-ball LARS, nothing excluded by default, LAMB's
exclusion keeping the trust ratio and matching name endings, LARS without weight decay
as plain momentum, a merge that grows the batch). A key bigbatch cannot honour is a
`ConfigError` naming it. The layout keys (hybrid, sharding, pipeline, tensor parallel,
parameter server) are in `bigbatch.config.fleet_layout`.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from typing import Any

from bigbatch.config.fields import closest, read_toml_source
from bigbatch.config.fleet_layout import CONFIG_TABLES, NO_EFFECT, layout
from bigbatch.config.fleet_record import FleetTranslation, refuse, take
from bigbatch.errors import ConfigError

__all__ = ["FleetTranslation", "translate"]

FILE_KEYS = ("task", "model", "batch_size")
"""Top-level keys that are not Fleet's: what the script itself says (its task, model,
and the DataLoader's per-card batch)."""


# -- the inner optimizer ---------------------------------------------------------------

OPTIMIZERS = {"Momentum": "momentum", "SGD": "momentum", "Adam": "adamw", "AdamW": "adamw"}
_OPTIMIZER_KEYS = {"type": None, "learning_rate": 0.001, "momentum": 0.9, "use_nesterov": False,
                   "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": None,
                   "grad_clip": None, "lr_scheduler": None}


def _optimizer(t: FleetTranslation, data: Mapping[str, Any], src: str) -> str:
    """[optimizer]: Paddle's optimizer class and its arguments; returns its type."""
    o = take(data.get("optimizer", {}), "optimizer", _OPTIMIZER_KEYS, src)
    kind = o["type"]
    if kind not in OPTIMIZERS:
        raise ConfigError(f"{src}: optimizer.type={kind!r}: give Paddle's inner optimizer, "
                          f"one of {', '.join(OPTIMIZERS)}")
    if o["lr_scheduler"] is not None:
        raise refuse(src, "optimizer.lr_scheduler", "Paddle's LR scheduler classes are not "
                     "translated; give a constant learning_rate (or write a bigbatch "
                     "strategy with [batch] warmup and decay)")
    t.set("optimizer.type", "optimizer.type", OPTIMIZERS[kind])
    t.set("optimizer.learning_rate", "batch.base_lr", float(o["learning_rate"]))
    t.set("(Fleet scales no LR)", "batch.scaling", "none")
    t.set("(no scheduler: constant LR)", "batch.decay", "none")
    t.set("(no scheduler: no warmup)", "batch.warmup_steps", 0)
    if OPTIMIZERS[kind] == "momentum":
        momentum = 0.0 if kind == "SGD" else float(o["momentum"])
        t.set("optimizer.momentum" if kind == "Momentum" else "(SGD: no momentum)",
              "optimizer.momentum", momentum)
        t.set("optimizer.use_nesterov" if "use_nesterov" in data.get("optimizer", {})
              else "(Momentum is heavy-ball)", "optimizer.nesterov", bool(o["use_nesterov"]))
    else:
        for key in ("beta1", "beta2", "epsilon"):
            t.set(f"optimizer.{key}", f"optimizer.{key}", float(o[key]))
    decay = o["weight_decay"]
    if kind == "AdamW" and decay is None:
        decay = 0.01  # paddle.optimizer.AdamW's default
    if decay:
        if kind == "Adam":
            raise refuse(src, "optimizer.weight_decay", "Paddle's Adam adds it to the "
                         "gradient (L2), bigbatch's adamw decays decoupled; use AdamW, or "
                         "lamb_configs.lamb_weight_decay with lamb")
        t.set("optimizer.weight_decay", "optimizer.weight_decay", float(decay))
        t.set("(Paddle excludes nothing)", "optimizer.exclude_from_weight_decay", [])
    clip = o["grad_clip"]
    if clip is not None:
        c = take(clip, "optimizer.grad_clip", {"type": None, "clip_norm": None}, src)
        if c["type"] != "ClipGradByGlobalNorm" or c["clip_norm"] is None:
            raise refuse(src, f"optimizer.grad_clip.type={c['type']!r}", "only "
                         'ClipGradByGlobalNorm (with clip_norm) has a bigbatch form')
        t.set("optimizer.grad_clip.clip_norm", "optimizer.max_grad_norm", float(c["clip_norm"]))
    return kind


# -- LARS, LAMB, merge, AMP, recompute ----------------------------------------------------

LARS_KEYS = {"lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0.0,
             "exclude_from_weight_decay": []}
LAMB_KEYS = {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": []}
MERGE_KEYS = {"k_steps": 1, "avg": True}
AMP_KEYS = {"init_loss_scaling": 32768.0, "incr_every_n_steps": 1000,
            "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0, "decr_ratio": 0.8,
            "use_dynamic_loss_scaling": True, "custom_white_list": [], "custom_black_list": [],
            "custom_black_varnames": [], "use_pure_fp16": False, "use_fp16_guard": True,
            "use_optimizer_fp16": False}
RECOMPUTE_KEYS = {"checkpoints": [], "enable_offload": False, "checkpoint_shape": []}


def _lars(t: FleetTranslation, data: Mapping[str, Any], kind: str, src: str) -> None:
    c = take(data.get("lars_configs", {}), "lars_configs", LARS_KEYS, src)
    if kind != "Momentum":
        raise ConfigError(f"{src}: lars = true needs optimizer.type = \"Momentum\" (Fleet's "
                          f"LARS wraps Momentum), got {kind!r}")
    t.set("lars", "lars.enable", True)
    for key in ("lars_coeff", "lars_weight_decay", "epsilon"):
        t.set(f"lars_configs.{key}", f"lars.{key}", float(c[key]))
    t.set("lars_configs.exclude_from_weight_decay", "lars.exclude_from_weight_decay",
          list(c["exclude_from_weight_decay"]))
    t.set("(lars matches substrings)", "lars.exclude_match", "substring")
    t.set("(no weight decay: plain momentum)", "lars.adapt_without_weight_decay", False)


def _lamb(t: FleetTranslation, data: Mapping[str, Any], kind: str, src: str) -> None:
    c = take(data.get("lamb_configs", {}), "lamb_configs", LAMB_KEYS, src)
    if kind != "Adam":
        raise ConfigError(f"{src}: lamb = true needs optimizer.type = \"Adam\" (Fleet applies "
                          f"LAMB to Adam only), got {kind!r}")
    t.set("lamb", "lamb.enable", True)
    t.set("lamb_configs.lamb_weight_decay", "lamb.lamb_weight_decay",
          float(c["lamb_weight_decay"]))
    t.set("lamb_configs.exclude_from_weight_decay", "lamb.exclude_from_weight_decay",
          list(c["exclude_from_weight_decay"]))
    t.set("(lamb matches name endings)", "lamb.exclude_match", "suffix")
    t.set("(excluded keep the trust ratio)", "lamb.always_adapt", True)
    t.set("(guide's equations: no 1-beta^t)", "lamb.bias_correction", False)


def _merge(t: FleetTranslation, data: Mapping[str, Any], src: str) -> int:
    c = take(data.get("gradient_merge_configs", {}), "gradient_merge_configs", MERGE_KEYS, src)
    t.set("gradient_merge", "gradient_merge.enable", True)
    t.set("gradient_merge_configs.k_steps", "gradient_merge.k_steps", int(c["k_steps"]))
    t.set("gradient_merge_configs.avg", "gradient_merge.avg", bool(c["avg"]))
    return int(c["k_steps"])


def _amp(t: FleetTranslation, data: Mapping[str, Any], src: str) -> None:
    c = take(data.get("amp_configs", {}), "amp_configs", AMP_KEYS, src)
    if c["use_pure_fp16"]:
        raise refuse(src, "amp_configs.use_pure_fp16", "bigbatch keeps float32 weights and "
                     "autocasts (O1); pure float16 weights (O2) are not available")
    if c["use_optimizer_fp16"]:
        raise refuse(src, "amp_configs.use_optimizer_fp16", "optimizer state stays float32")
    if c["custom_black_varnames"]:
        raise refuse(src, "amp_configs.custom_black_varnames", "autocast exceptions are by "
                     "op (custom_black_list), not by variable name")
    t.set("amp", "amp.enable", True)
    t.set("(Fleet's amp is float16)", "amp.dtype", "float16")
    for key in ("init_loss_scaling", "incr_ratio", "decr_ratio"):
        t.set(f"amp_configs.{key}", f"amp.{key}", float(c[key]))
    for key in ("incr_every_n_steps", "decr_every_n_nan_or_inf"):
        t.set(f"amp_configs.{key}", f"amp.{key}", int(c[key]))
    t.set("amp_configs.use_dynamic_loss_scaling", "amp.use_dynamic_loss_scaling",
          bool(c["use_dynamic_loss_scaling"]))
    for key in ("custom_white_list", "custom_black_list"):
        if c[key]:
            t.set(f"amp_configs.{key}", f"amp.{key}", list(c[key]))
    if "use_fp16_guard" in data.get("amp_configs", {}):
        t.note("amp_configs.use_fp16_guard", "(no effect: it guards pure fp16 only)")


def _recompute(t: FleetTranslation, data: Mapping[str, Any], src: str) -> None:
    c = take(data.get("recompute_configs", {}), "recompute_configs", RECOMPUTE_KEYS, src)
    if c["enable_offload"]:
        raise refuse(src, "recompute_configs.enable_offload", "recomputed activations are "
                     "not offloaded to host memory")
    t.set("recompute", "recompute.enable", True)
    t.set("recompute_configs.checkpoints", "recompute.checkpoints", list(c["checkpoints"]))
    if c["checkpoint_shape"]:
        t.note("recompute_configs.checkpoint_shape", "(no effect: shapes are known here)")


# -- the whole file -----------------------------------------------------------------------------

SWITCHES = ("lars", "lamb", "gradient_merge", "amp", "recompute", "sharding", "pipeline",
            "tensor_parallel", "a_sync", "dgc", "localsgd", "adaptive_localsgd",
            "sync_batch_norm", "find_unused_parameters")

COLLECTIVE_ONLY = ("lars", "lamb", "gradient_merge", "amp", "recompute")
"""Switches whose Fleet meta-optimizer applies only in a collective job: each one's
`_can_apply` starts with ``if not self.role_maker._is_collective: return False``
(paddle/distributed/fleet/meta_optimizers/{lars,lamb,gradient_merge,amp,recompute}
_optimizer.py), so under `a_sync` (a parameter-server job) Fleet trains without them."""

HALF_ASYNC = ("Paddle's half-async (1.x StrategyFactory.create_half_async_strategy; no "
              "DistributedStrategy key selects it: a_sync and a_sync_configs.k_steps give sync, "
              "async or GEO) sums each trainer's CPU_NUM thread gradients into one push, waits "
              "for it and pulls the parameters, while the servers apply every push as it "
              "arrives; bigbatch's async worker also waits and pulls: write a_sync = true with "
              "--set gradient_merge.k_steps=CPU_NUM --set gradient_merge.avg=false --set "
              "parameter_server.max_staleness=1000000 (Paddle drops no stale gradient)")
"""The one line for a `half_async` key: what Paddle's HalfAsyncCommunicator does
(communicator.cc: SendByCommunicator merges with MergeVars(merge_add), RecvByCommunicator
pulls, no BarrierSend/BarrierRecv; the dense table is not sync, so push_dense applies at
once) and the bigbatch settings with its arithmetic (tests/test_ps_half_async.py)."""


def translate(path_or_text: str | os.PathLike) -> FleetTranslation:
    """Read a Fleet strategy file (or TOML text) and translate it; see the module doc."""
    source, text = read_toml_source(path_or_text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    t = FleetTranslation(source=source)
    tables = {"optimizer", "lars_configs", "lamb_configs", "gradient_merge_configs",
              "amp_configs", "recompute_configs", *CONFIG_TABLES}
    for key, value in data.items():
        if key in FILE_KEYS or key in tables or key in NO_EFFECT:
            continue
        if key == "half_async":
            raise refuse(source, key, HALF_ASYNC)
        if key not in SWITCHES:
            known = [*SWITCHES, *tables, *NO_EFFECT, *FILE_KEYS]
            guess = closest(key, known)
            hint = f"; did you mean `{guess}`?" if guess else ""
            raise refuse(source, key, f"no bigbatch form{hint}")
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} = {value!r}: a Fleet switch is true or false")
    for name in tables:
        switch = name.removesuffix("_configs")
        if name in data and name != "optimizer" and switch in SWITCHES and not data.get(switch):
            t.note(name, f"(not applied: {switch} is not true, as in Fleet)")
    t.task = data.get("task")
    kind = _optimizer(t, data, source)
    k_steps = 1
    on = {name: bool(data.get(name)) for name in COLLECTIVE_ONLY}
    if data.get("a_sync"):  # a parameter-server job: Fleet leaves these out
        for name in [n for n, v in on.items() if v]:
            t.note(name, "(not applied, as in Fleet: its meta-optimizer runs in collective "
                   "jobs only, and a_sync makes this a parameter-server job)")
            on[name] = False
    if on["lars"]:
        _lars(t, data, kind, source)
    if on["lamb"]:
        _lamb(t, data, kind, source)
    if on["gradient_merge"]:
        k_steps = _merge(t, data, source)
    if on["amp"]:
        _amp(t, data, source)
    if on["recompute"]:
        _recompute(t, data, source)
    layout(t, data, source)
    _batch(t, data, k_steps, source)
    return t


def _batch(t: FleetTranslation, data: Mapping[str, Any], k_steps: int, src: str) -> None:
    """The script's per-card batch: bigbatch's micro batch; the global batch is left to
    follow (micro x k_steps x data-parallel ranks), so a merge grows it k-fold."""
    size = data.get("batch_size")
    pipe = t.strategy.get("pipeline", {})
    if pipe.get("enable"):
        micro, steps = pipe.get("micro_batch_size"), pipe.get("accumulate_steps")
        if size is not None and micro and steps and size != micro * steps:
            raise ConfigError(f"{src}: batch_size={size} is not pipeline_configs."
                              f"micro_batch_size {micro} x accumulate_steps {steps}")
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{src}: batch_size = {size!r}: give the per-card batch of the "
                          "Fleet script's DataLoader (an int >= 1)")
    t.set("batch_size (per card)", "batch.micro_batch_size", size)
    t.set("(recipe batch: the per card one)", "batch.base_batch_size", size)
    t.note("(Fleet's batch)", f"global = {size} x k_steps {k_steps} x data-parallel ranks")
