"""Which settings cannot go together, why, and the fix: one table, `CONFLICTS`.

Each row names two features (or a feature and a condition of the run), the reason, the
fix, and the one line the user sees. `Strategy` validation, `prepare()` and the CLI's
preflight call `check`, which raises the first row that applies as a `ConfigError`;
`docs/compatibility.md` is rendered from the table (`bigbatch.config.compat_docs`), and
the tests build each row's `example` and expect exactly its message. The table's order is
the order of precedence when several rows apply.

A row that needs more than the strategy (`given`: the user's own optimizer, the worker's
device, ...) applies where a check knows that fact (`Context`). Limits of one key, or of
keys within one section, stay with the section's fields."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bigbatch.config.batch_schedule_rows import BATCH_SCHEDULE_ROWS, batch_changer
from bigbatch.config.comm import LOSSY, adasum_target, local_sgd_section, reduce_mode
from bigbatch.config.conflict import NO_CONTEXT, Conflict, Context
from bigbatch.config.lr_find_rows import LR_FIND_ROWS
from bigbatch.config.schedules import growth_of
from bigbatch.errors import ConfigError

__all__ = ["CONFLICTS", "Conflict", "Context", "check", "conflicts"]


# -- facts the rows read --------------------------------------------------------------------


def _tp(s: Any) -> bool:
    return s.tensor_parallel.tensor_parallel_degree > 1


def _pipedream(s: Any) -> bool:
    return s.pipeline.enable and s.pipeline.schedule_mode == "PipeDream"


def _meshed(s: Any) -> str | None:
    """The first of [sharding], tensor or pipeline parallelism in use, as messages name it."""
    return ("[sharding]" if s.sharding.enable else "tensor parallelism" if _tp(s)
            else "[pipeline]" if s.pipeline.enable else None)


def _clip(s: Any) -> float | None:
    """The global-norm clip in force (as `Strategy.max_grad_norm()`)."""
    if s.lamb.enable and s.lamb.max_grad_norm is not None:
        return s.lamb.max_grad_norm
    return s.optimizer.max_grad_norm


def _gns_key(s: Any, policies: bool = True, doubling: bool = True) -> str | None:
    """The first `[adaptive]` setting that reads the noise scale, as a user writes it;
    `policies`: goodput chosen in `policies` counts; `doubling`: so does
    noise_scale_doubling (the messages name them as they always have)."""
    a = s.adaptive
    goodput = a.goodput if policies else a.batch_size == "goodput"
    return ("adaptive.noise_scale=true" if a.noise_scale else
            f'adaptive.lr="{a.lr}"' if a.lr != "none" else
            'adaptive.batch_size="goodput"' if goodput else
            'adaptive.policies=["noise_scale_doubling"]'
            if doubling and "noise_scale_doubling" in a.policies else
            f'batch.schedule="{s.batch.schedule}"'
            if growth_of(s) == "adaptive" else None)


def _switched_on(s: Any) -> str | None:
    return _gns_key(s, policies=False, doubling=False)


def _local(s: Any) -> str:
    return f"[{local_sgd_section(s).section}]"


def _lossy(s: Any) -> bool:
    return reduce_mode(s) in LOSSY


def _fp16(s: Any) -> bool:
    return s.amp.enable and s.amp.dtype == "float16"


_MESH = "[sharding], tensor parallelism or [pipeline]"
_TP2 = {"tensor_parallel": {"tensor_parallel_degree": 2}}
_NOISE = {"noise_scale": True}
_PIPEDREAM = {"schedule_mode": "PipeDream"}
_OFF = "switch one off"
_SWITCH = 'adaptive.policies = ["sync_switch"]'


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _switching(s: Any) -> bool:
    return "sync_switch" in s.adaptive.policies

# -- the table ------------------------------------------------------------------------------

C = Conflict
CONFLICTS: tuple[Conflict, ...] = (
    # the optimizer
    C("lars-lamb", "[lars]", "[lamb]", lambda s, c: s.lars.enable and s.lamb.enable,
      "{a} and {b} are both enabled; {fix}",
      "each is the whole optimizer (LARS over momentum SGD, LAMB over AdamW)",
      "enable at most one of them", {"lars": {}, "lamb": {}}),
    C("lars-adamw", "[lars]", 'optimizer.type = "adamw"',
      lambda s, c: s.lars.enable and s.optimizer.type != "momentum",
      '{a} needs optimizer.type = "momentum" ({reason}), got "{s.optimizer.type}"',
      "LARS wraps momentum SGD", 'set optimizer.type = "momentum"',
      {"lars": {}, "optimizer": {"type": "adamw"}}),
    C("lamb-momentum", "[lamb]", 'optimizer.type = "momentum"',
      lambda s, c: s.lamb.enable and s.optimizer.type != "adamw",
      '{a} needs optimizer.type = "adamw" ({reason}), got "{s.optimizer.type}"',
      "LAMB wraps AdamW", 'set optimizer.type = "adamw"', {"lamb": {}}),
    C("muon-lars-lamb", "[muon]", "[lars] or [lamb]",
      lambda s, c: s.muon.enable and (s.lars.enable or s.lamb.enable),
      "{a} and {b} are both enabled; {fix}", "each is the whole optimizer of the hidden matrices",
      "enable one of them", {"muon": {}, "lamb": {}, "optimizer": {"type": "adamw"}}),
    C("muon-momentum", "[muon]", 'optimizer.type = "momentum"',
      lambda s, c: s.muon.enable and s.optimizer.type != "adamw",
      '{a} needs optimizer.type = "adamw" ({reason}), got "{s.optimizer.type}"',
      "AdamW takes the embeddings, head, norms and biases", 'set optimizer.type = "adamw"',
      {"muon": {}}),
    *(C(f"{name}-weight-decay", "optimizer.weight_decay > 0", f"[{name}]",
        lambda s, c, name=name: getattr(s, name).enable and s.optimizer.weight_decay != 0,
        "optimizer.weight_decay={s.optimizer.weight_decay} with {b} would decay twice; {fix}",
        f"[{name}] applies its own weight decay", f"set it to 0 and use {name}.{name}_weight_decay",
        {name: {}, "optimizer": {"type": opt, "weight_decay": 0.01}})
      for name, opt in (("lars", "momentum"), ("lamb", "adamw"), ("muon", "adamw"))),
    # the pipeline
    C("pipeline-gradient-merge", "[gradient_merge]", "[pipeline]",
      lambda s, c: s.pipeline.enable and s.gradient_merge.enable, "{a} with {b}: {reason}; {fix}",
      "the pipeline's micro-batches are the merge",
      "set pipeline.accumulate_steps instead of gradient_merge.k_steps",
      {"pipeline": {}, "gradient_merge": {}}),
    C("pipeline-micro-batch", "pipeline.micro_batch_size", "another batch.micro_batch_size",
      lambda s, c: (s.pipeline.enable and s.pipeline.micro_batch_size
                    and s.batch.micro_batch_size
                    and s.pipeline.micro_batch_size != s.batch.micro_batch_size),
      "pipeline.micro_batch_size={s.pipeline.micro_batch_size} and batch.micro_batch_size="
      "{s.batch.micro_batch_size} disagree; {fix}", "two sizes for one micro-batch",
      "set one of them", {"pipeline": {"micro_batch_size": 4}, "batch": {"micro_batch_size": 8}}),
    C("pipedream-clipping", "optimizer.max_grad_norm or lamb.max_grad_norm",
      'pipeline.schedule_mode = "PipeDream"', lambda s, c: _pipedream(s) and _clip(s) is not None,
      "max_grad_norm (clipping) with {b}: {reason}",
      "its stages update per micro-batch, with no step's whole gradient to clip",
      "unset max_grad_norm, or use another schedule",
      {"pipeline": _PIPEDREAM, "optimizer": {"max_grad_norm": 1.0}}),
    C("pipeline-zero1", "sharding.stage = 1", "[pipeline]",
      lambda s, c: s.pipeline.enable and s.sharding.enable and s.sharding.stage == 1,
      "sharding.stage=1 with {b} is not supported; {fix}",
      "stage 1 is ZeroRedundancyOptimizer over a whole-model DDP", "use stage 2 or 3",
      {"pipeline": {}, "sharding": {"stage": 1}}),
    C("pipedream-adaptive", "[adaptive] (the noise scale)", 'pipeline.schedule_mode = "PipeDream"',
      lambda s, c: _pipedream(s) and s.adaptive.active, "[adaptive] with {b}: {reason}; {fix}",
      "its stages update after every micro-batch, so no step has a big-batch gradient to "
      "measure", 'use "GPipe", "1F1B" or "Interleaved1F1B"',
      {"pipeline": _PIPEDREAM, "adaptive": _NOISE}),
    C("pipeline-batch-change", "[adaptive] goodput or noise_scale_doubling", "[pipeline]",
      lambda s, c: s.pipeline.enable and s.adaptive.active and batch_changer(s) is not None,
      "{key} with {b}: {reason}; {fix}",
      "the pipeline's schedules are built for pipeline.accumulate_steps micro-batches of one "
      "shape, so the batch cannot change during a run",
      'keep adaptive.noise_scale or adaptive.lr="adascale"',
      {"pipeline": {}, "adaptive": {"batch_size": "goodput"}},
      values=lambda s, c: {"key": batch_changer(s)}),
    C("pipedream-alone", 'pipeline.schedule_mode = "PipeDream"',
      "[sharding], tensor parallelism or [amp]",
      lambda s, c: _pipedream(s) and (s.sharding.enable or _tp(s) or s.amp.enable),
      "{a} runs alone: without {b}",
      "its asynchronous per-micro-batch updates are implemented for plain stages only",
      "switch the others off, or use another schedule",
      {"pipeline": _PIPEDREAM, "amp": {}}),
    # sharded, sliced or pipelined models
    C("mesh-reduce", 'data_parallel.reduce other than "mean"', _MESH,
      lambda s, c: _meshed(s) is not None and reduce_mode(s) != "mean",
      "data_parallel.reduce={mode!r} with {what}: {how} {reason}; {fix}",
      "whole per-worker gradients, which sharded or sliced gradients are not",
      'use reduce = "mean"', {"sharding": {}, "data_parallel": {"reduce": "fp16"}},
      values=lambda s, c: {"mode": reduce_mode(s), "what": _meshed(s),
                           "how": "Adasum combines" if reduce_mode(s) == "adasum" else
                           "that reduce is a DDP comm hook over"}),
    C("pipeline-sharding-adaptive", "[adaptive] (the noise scale)", "[pipeline] with [sharding]",
      lambda s, c: s.adaptive.active and s.sharding.enable and s.pipeline.enable,
      "{key} with [pipeline] and [sharding]: {reason}; {fix}",
      "each stage is then an FSDP2 module, which accumulates the micro-batches' gradients in "
      "its own copies, so micro-batch 0's gradient never reaches the parameters",
      "switch [sharding] off (the stages' data parallelism is then DDP) or [adaptive] off",
      {"pipeline": {}, "sharding": {}, "adaptive": _NOISE},
      values=lambda s, c: {"key": _gns_key(s, doubling=False) or "[adaptive]"}),
    C("sharded-adaptive", "[adaptive] (the noise scale)", "[sharding] or tensor parallelism",
      lambda s, c: s.adaptive.active and (s.sharding.enable or _tp(s)),
      "[adaptive] with {what}: {reason}; {fix}",
      "the noise scale, AdaScale and goodput need each worker's whole gradient before it is "
      "reduced, which sharded or sliced gradients are not",
      "switch [adaptive] off or use plain data parallelism", {"sharding": {}, "adaptive": _NOISE},
      values=lambda s, c: {"what": _meshed(s)}),
    C("mesh-straggler", 'adaptive.policies = ["straggler"]', _MESH,
      lambda s, c: _meshed(s) is not None and "straggler" in s.adaptive.policies,
      "{a} with {what}: {reason}; {fix}",
      "compute time is told apart from the wait for other workers in DDP's backward only, "
      "and rebalancing changes each worker's batch", "use plain data parallelism",
      {**_TP2, "adaptive": {"policies": ["straggler"]}}, values=lambda s, c: {"what": _meshed(s)}),
    C("tensor-parallel-zero1", "sharding.stage = 1", "tensor parallelism",
      lambda s, c: s.sharding.enable and s.sharding.stage == 1 and _tp(s),
      "sharding.stage=1 (ZeroRedundancyOptimizer over DDP) does not combine with "
      "tensor_parallel_degree > 1; {fix}",
      "stage 1 is ZeroRedundancyOptimizer over a whole-model DDP", "use sharding.stage 2 or 3",
      {"sharding": {"stage": 1}, **_TP2}),
    C("mesh-sync-batch-norm", "data_parallel.sync_batch_norm", _MESH,
      lambda s, c: _meshed(s) is not None and s.data_parallel.sync_batch_norm,
      "data_parallel.sync_batch_norm with {what} is not supported; {fix}",
      "bigbatch runs SyncBatchNorm with plain data parallelism (DDP) only", _OFF,
      {"pipeline": {}, "data_parallel": {"sync_batch_norm": True}},
      values=lambda s, c: {"what": _meshed(s)}),
    C("lamb-clipping", "lamb.max_grad_norm", "optimizer.max_grad_norm",
      lambda s, c: s.lamb.enable and None not in (s.lamb.max_grad_norm, s.optimizer.max_grad_norm),
      "lamb.max_grad_norm={s.lamb.max_grad_norm} and optimizer.max_grad_norm="
      "{s.optimizer.max_grad_norm} are one setting (clip the global gradient norm); {fix}",
      "both clip the global gradient norm", "set one",
      {"lamb": {"max_grad_norm": 1.0}, "optimizer": {"type": "adamw", "max_grad_norm": 1.0}}),
    # K-FAC
    C("kfac-optimizer", "[kfac]", 'optimizer.type = "adamw" or [lamb]',
      lambda s, c: s.kfac.enable and s.optimizer.type != "momentum",
      "{a} needs momentum SGD or [lars] inside it; {inner} is not supported ({fix})",
      "K-FAC preconditions the gradient for momentum SGD or LARS",
      'set optimizer.type = "momentum"', {"kfac": {}, "optimizer": {"type": "adamw"}},
      values=lambda s, c: {"inner": "[lamb]" if s.lamb.enable
                           else f'optimizer.type = "{s.optimizer.type}"'}),
    C("kfac-split", "[kfac]", "[sharding], [pipeline] or tensor parallelism",
      lambda s, c: s.kfac.enable and (s.sharding.enable or s.pipeline.enable or _tp(s)),
      "{a} with {split}: {reason}; {fix}",
      "K-FAC needs every layer's whole gradient and activations on each rank",
      "use plain data parallelism", {"kfac": {}, "pipeline": {}},
      values=lambda s, c: {"split": "[sharding]" if s.sharding.enable else "[pipeline]"
                           if s.pipeline.enable else "tensor parallelism"}),
    # the reduce: compressed, DGC
    C("dgc-reduce", "[dgc]", 'another data_parallel.reduce',
      lambda s, c: s.dgc.enable and s.data_parallel.reduce not in ("mean", "dgc"),
      '{a} with data_parallel.reduce="{s.data_parallel.reduce}": {reason}; {fix}',
      "DGC is a reduce of its own", 'remove [dgc] or set data_parallel.reduce = "dgc"',
      {"dgc": {}, "data_parallel": {"reduce": "adasum"}}),
    C("lossy-adaptive", 'data_parallel.reduce = "powersgd" or "dgc" ([dgc])', "[adaptive]",
      lambda s, c: _lossy(s) and _switched_on(s) is not None,
      'data_parallel.reduce="{mode}" with {on}: {reason}; {fix}',
      "the noise scale needs the plain mean of the workers' gradients",
      'use reduce = "mean", "fp16" or "bf16"',
      {"data_parallel": {"reduce": "powersgd"}, "adaptive": _NOISE},
      values=lambda s, c: {"mode": reduce_mode(s), "on": _switched_on(s)}),
    C("lossy-float16", 'data_parallel.reduce = "powersgd" or "dgc" ([dgc])',
      'amp.dtype = "float16"',
      lambda s, c: _lossy(s) and _fp16(s), 'data_parallel.reduce="{mode}" with amp.dtype='
      '"float16": {reason}; {fix}', "its error feedback would keep an overflowing (inf) "
      "loss-scaled gradient for good", 'use amp.dtype = "bfloat16"',
      {"dgc": {}, "amp": {"dtype": "float16"}}, values=lambda s, c: {"mode": reduce_mode(s)}),
    C("dgc-optimizer", 'data_parallel.reduce = "dgc" ([dgc])',
      '[lars], [lamb] or optimizer.type = "adamw"',
      lambda s, c: (reduce_mode(s) == "dgc"
                    and (s.lars.enable or s.lamb.enable or s.optimizer.type != "momentum")),
      'data_parallel.reduce="dgc" with {name}: {reason}; {fix}',
      "DGC's momentum correction replaces the optimizer's momentum",
      'use optimizer.type = "momentum" without [lars]/[lamb]', {"dgc": {}, "lars": {}},
      values=lambda s, c: {"name": "[lars]" if s.lars.enable else "[lamb]" if s.lamb.enable
                           else f'optimizer.type="{s.optimizer.type}"'}),
    C("dgc-nesterov", 'data_parallel.reduce = "dgc" ([dgc])', "optimizer.nesterov",
      lambda s, c: reduce_mode(s) == "dgc" and s.optimizer.nesterov is True,
      'data_parallel.reduce="dgc" with optimizer.nesterov=true: {reason}; {fix}',
      "DGC's momentum correction is plain momentum", "set nesterov = false",
      {"data_parallel": {"reduce": "dgc"}, "optimizer": {"nesterov": True}}),
    # local SGD
    C("localsgd-twice", "[localsgd]", "[adaptive_localsgd]",
      lambda s, c: s.localsgd.enable and s.adaptive_localsgd.enable,
      "{a} and {b} are both enabled; {fix}", "both choose when the models are averaged",
      "enable one", {"localsgd": {}, "adaptive_localsgd": {}}),
    C("localsgd-reduce", "[localsgd] or [adaptive_localsgd]", 'data_parallel.reduce other than '
      '"mean"', lambda s, c: local_sgd_section(s) is not None and reduce_mode(s) != "mean",
      '{local} with data_parallel.reduce="{mode}": {reason}; {fix}',
      "local SGD averages models, not gradients", 'use reduce = "mean"',
      {"localsgd": {}, "data_parallel": {"reduce": "bf16"}},
      values=lambda s, c: {"local": _local(s), "mode": reduce_mode(s)}),
    C("localsgd-adaptive", "[localsgd] or [adaptive_localsgd]", "[adaptive]",
      lambda s, c: local_sgd_section(s) is not None and _switched_on(s) is not None,
      "{local} with {on}: {reason}; {fix}", "local steps have no all-reduced gradient to "
      "measure", _OFF, {"adaptive_localsgd": {}, "adaptive": {"lr": "adascale"},
                        "batch": {"scaling": "none"}},
      values=lambda s, c: {"local": _local(s), "on": _switched_on(s)}),
    C("localsgd-mesh", "[localsgd] or [adaptive_localsgd]", _MESH,
      lambda s, c: local_sgd_section(s) is not None and _meshed(s) is not None,
      "{local} with {what} is not supported: {reason}; {fix}",
      "local SGD averages whole per-worker models (DDP)", _OFF, {"localsgd": {}, "sharding": {}},
      values=lambda s, c: {"local": _local(s), "what": _meshed(s)}),
    C("localsgd-sync-batch-norm", "[localsgd] or [adaptive_localsgd]",
      "data_parallel.sync_batch_norm",
      lambda s, c: local_sgd_section(s) is not None and s.data_parallel.sync_batch_norm,
      "{local} with data_parallel.sync_batch_norm: {reason}; {fix}",
      "local steps do not synchronise", _OFF,
      {"localsgd": {}, "data_parallel": {"sync_batch_norm": True}},
      values=lambda s, c: {"local": _local(s)}),
    # the sync_switch policy: all-reduce <-> local SGD while the job runs
    C("sync-switch-localsgd", _SWITCH, "[localsgd] or [adaptive_localsgd]",
      lambda s, c: _switching(s) and local_sgd_section(s) is not None,
      "{a} with {local}: {reason}; {fix}", "both choose when the workers synchronise",
      "keep one of them", {"adaptive": {"policies": ["sync_switch"]}, "localsgd": {}},
      values=lambda s, c: {"local": _local(s)}),
    C("sync-switch-mesh", _SWITCH, _MESH,
      lambda s, c: _switching(s) and _meshed(s) is not None,
      "{a} with {what}: {reason}; {fix}",
      "its local phase averages whole per-worker models (DDP)", "use plain data parallelism",
      {**_TP2, "adaptive": {"policies": ["sync_switch"]}},
      values=lambda s, c: {"what": _meshed(s)}),
    C("sync-switch-reduce", _SWITCH, 'data_parallel.reduce other than "mean"',
      lambda s, c: _switching(s) and reduce_mode(s) != "mean",
      '{a} with data_parallel.reduce="{mode}": {reason}; {fix}',
      "it switches between local steps and the plain mean", 'use reduce = "mean"',
      {"adaptive": {"policies": ["sync_switch"]}, "data_parallel": {"reduce": "bf16"}},
      values=lambda s, c: {"mode": reduce_mode(s)}),
    C("sync-switch-adaptive", _SWITCH, "[adaptive] (the noise scale)",
      lambda s, c: _switching(s) and _gns_key(s) is not None,
      "{a} with {on}: {reason}; {fix}", "local steps have no all-reduced gradient to measure",
      _OFF, {"adaptive": {"policies": ["sync_switch"], "noise_scale": True}},
      values=lambda s, c: {"on": _gns_key(s)}),
    C("sync-switch-sync-batch-norm", _SWITCH, "data_parallel.sync_batch_norm",
      lambda s, c: _switching(s) and s.data_parallel.sync_batch_norm,
      "{a} with {b}: {reason}; {fix}", "local steps do not synchronise", _OFF,
      {"adaptive": {"policies": ["sync_switch"]}, "data_parallel": {"sync_batch_norm": True}}),
    # the parameter server
    C("ps-mesh", "[parameter_server]", _MESH,
      lambda s, c: s.parameter_server.enable and _meshed(s) is not None,
      "{a} with {what}: {reason}; {fix}", "servers hold whole tensors for whole-model workers",
      _OFF, {"parameter_server": {}, **_TP2}, values=lambda s, c: {"what": _meshed(s)}),
    C("ps-reduce", "[parameter_server]", 'data_parallel.reduce other than "mean"',
      lambda s, c: s.parameter_server.enable and reduce_mode(s) != "mean",
      '{a} with data_parallel.reduce="{mode}": {reason}; {fix}',
      "the servers combine the gradients", 'use reduce = "mean"',
      {"parameter_server": {}, "data_parallel": {"reduce": "adasum"}},
      values=lambda s, c: {"mode": reduce_mode(s)}),
    C("ps-localsgd", "[parameter_server]", "[localsgd] or [adaptive_localsgd]",
      lambda s, c: s.parameter_server.enable and local_sgd_section(s) is not None,
      "{a} with {local}: {fix}", "the servers apply every worker's gradient; local SGD "
      "averages models instead", _OFF, {"parameter_server": {}, "localsgd": {}},
      values=lambda s, c: {"local": _local(s)}),
    C("ps-sync-switch", "[parameter_server]", _SWITCH,
      lambda s, c: s.parameter_server.enable and _switching(s),
      "{a} with {b}: {reason}; {fix}", "the servers combine the gradients; there is no "
      "all-reduce to switch", _OFF,
      {"parameter_server": {}, "adaptive": {"policies": ["sync_switch"]}}),
    C("ps-adaptive", "[parameter_server]", "[adaptive]",
      lambda s, c: s.parameter_server.enable and _switched_on(s) is not None,
      "{a} with {on} is not supported; {fix}", "the noise scale compares a worker's gradient "
      "with the all-reduced one, and the servers replace the all-reduce", _OFF,
      {"parameter_server": {}, "adaptive": _NOISE}, values=lambda s, c: {"on": _switched_on(s)}),
    C("ps-float16", "[parameter_server]", 'amp.dtype = "float16"',
      lambda s, c: s.parameter_server.enable and _fp16(s),
      '{a} with amp.dtype="float16": {reason}; {fix}', "the servers keep no loss scale",
      'use amp.dtype = "bfloat16"', {"parameter_server": {}, "amp": {}}),
    C("ps-sync-batch-norm", "[parameter_server]", "data_parallel.sync_batch_norm",
      lambda s, c: s.parameter_server.enable and s.data_parallel.sync_batch_norm,
      "{a} with data_parallel.sync_batch_norm is not supported; {fix}",
      "the workers do not run DDP, which SyncBatchNorm synchronises in", _OFF,
      {"parameter_server": {}, "data_parallel": {"sync_batch_norm": True}}),
    C("ps-lamb-clipping", "lamb.max_grad_norm", "parameter_server.servers > 1",
      lambda s, c: (s.parameter_server.enable and s.parameter_server.servers > 1
                    and s.lamb.enable and s.lamb.max_grad_norm is not None),
      "{a} with parameter_server.servers={s.parameter_server.servers}: {reason}; {fix}",
      "the global norm spans shards on other servers", "use servers = 1",
      {"parameter_server": {"servers": 2}, "lamb": {"max_grad_norm": 1.0},
       "optimizer": {"type": "adamw"}}),
    # adaptive
    C("adascale-scaling", 'adaptive.lr = "adascale"', 'batch.scaling other than "none"',
      lambda s, c: s.adaptive.lr == "adascale" and s.batch.scaling != "none",
      '{a} supplies its own LR gain; {fix} (got "{s.batch.scaling}")',
      "AdaScale's gain takes the place of the batch scaling rule",
      'set batch.scaling = "none"', {"adaptive": {"lr": "adascale"}}),
    C("straggler-rebalance-adaptive", 'straggler.action = "rebalance"',
      "[adaptive] (the noise scale)",
      lambda s, c: ("straggler" in s.adaptive.policies and s.straggler.action == "rebalance"
                    and _gns_key(s) is not None),
      "{a} with the noise scale tracked ([adaptive] noise_scale, AdaScale, goodput or "
      "noise_scale_doubling): {reason}; {fix}",
      "unequal micro batches bias its per-worker estimate", 'use action = "warn" or "stop" there',
      {"adaptive": {"policies": ["straggler"], "noise_scale": True},
       "straggler": {"action": "rebalance"}}),
    *LR_FIND_ROWS,  # the LR range test before training
    *BATCH_SCHEDULE_ROWS,  # a batch that grows during the run
    # prepare(): the model and the worker
    C("own-optimizer-lars-lamb", "[lars], [lamb] or [muon]", "prepare(optimizer=...)",
      lambda s, c: c.own_optimizer and (s.lars.enable or s.lamb.enable or s.muon.enable),
      "[{name}] builds its own optimizer; with prepare(..., optimizer=...) switch [{name}] off "
      "({fix})", "each builds its own optimizer", "your optimizer is used as it is", {"lars": {}},
      Context(own_optimizer=True), lambda s, c: {"name": "lars" if s.lars.enable else
                                                 "lamb" if s.lamb.enable else "muon"}),
    C("own-optimizer-mesh", "prepare(optimizer=...)", "[sharding], tensor or pipeline parallelism",
      lambda s, c: c.own_optimizer and (
          s.sharding.enable or _tp(s) or (s.pipeline.enable and s.pipeline.pp_degree > 1)),
      "prepare(..., optimizer=...) with {b}: {reason}; {fix}",
      "they replace the parameters your optimizer holds", "let the strategy build it",
      {"sharding": {"stage": 1}}, Context(own_optimizer=True)),
    C("tensor-parallel-plan", "tensor parallelism", "a model without a tensor-parallel plan",
      lambda s, c: not c.tp_plan and _tp(s),
      "tensor_parallel.tensor_parallel_degree={s.tensor_parallel.tensor_parallel_degree}: "
      "no tensor-parallel plan for this model; {fix}",
      "the model's layers are sliced as a plan says",
      "pass prepare(..., tp_plan=...) (module name -> style, or a callable)", _TP2,
      Context(tp_plan=False)),
    C("sync-batch-norm-device", "data_parallel.sync_batch_norm", "a worker without CUDA",
      lambda s, c: s.data_parallel.sync_batch_norm and c.distributed and c.device != "cuda",
      "data_parallel.sync_batch_norm=true needs CUDA devices ({reason}); this worker runs on "
      "{c.device}", "torch's SyncBatchNorm is GPU-only", "use CUDA workers, or switch it off",
      {"data_parallel": {"sync_batch_norm": True}}, Context(distributed=True, device="cpu")),
    # the preflight: the machine
    C("nccl-machine", 'data_parallel.backend = "nccl"', "a machine without CUDA",
      lambda s, c: not c.cuda and s.data_parallel.backend == "nccl",
      "data_parallel.backend='nccl' needs CUDA devices and this machine has none; {fix}",
      "NCCL runs on CUDA devices only", 'use "gloo" or "auto"',
      {"data_parallel": {"backend": "nccl"}}, Context(cuda=False)),
    C("sync-batch-norm-machine", "data_parallel.sync_batch_norm", "a machine without CUDA",
      lambda s, c: (not c.cuda and s.data_parallel.sync_batch_norm
                    and (c.world_size is None or c.world_size > 1)),
      "data_parallel.sync_batch_norm=true needs CUDA devices ({reason}) and this machine has "
      "none", "torch's SyncBatchNorm is GPU-only", "run it on CUDA devices, or switch it off",
      {"data_parallel": {"sync_batch_norm": True}}, Context(cuda=False)),
    # a run of the strategy
    C("adasum-adaptive", 'data_parallel.reduce = "adasum"', "[adaptive] (the noise scale)",
      lambda s, c: s.data_parallel.reduce == "adasum" and _gns_key(s) is not None,
      "data_parallel.reduce='adasum' cannot be combined with {on}: {reason}; {fix}",
      "the noise scale needs the mean of the workers' gradients", "use reduce='mean'",
      {"data_parallel": {"reduce": "adasum"}, "adaptive": _NOISE}, Context(run=True),
      lambda s, c: {"on": _gns_key(s)}),
    C("adasum-delta-fp16", 'data_parallel.reduce = "adasum" on deltas', "amp.dtype = float16",
      lambda s, c: adasum_target(s) == "delta" and _fp16(s),
      "{a} (adasum_on, optimizer.type adamw) with {b}: {reason}; {fix}",
      "each worker's loss scaler would see only its own gradient's overflows, so workers "
      "would skip different steps", 'use amp.dtype = "bfloat16", or adasum_on = "gradient"',
      {"data_parallel": {"reduce": "adasum", "adasum_on": "delta"}, "amp": {"dtype": "float16"}}),
    C("dgc-own-optimizer", 'data_parallel.reduce = "dgc" ([dgc])', "prepare(optimizer=...)",
      lambda s, c: c.own_optimizer and c.distributed and reduce_mode(s) == "dgc",
      'data_parallel.reduce = "dgc" {reason}; {fix}', "applies momentum and weight decay "
      "inside its reduction and so builds its own optimizer", "drop prepare(optimizer=...)",
      {"dgc": {}}, Context(own_optimizer=True, distributed=True)),
    C("unused-parameters-fsdp", "data_parallel.find_unused_parameters = true",
      "sharding.stage = 2 or 3 on torch older than 2.13",
      lambda s, c: (s.data_parallel.find_unused_parameters and s.sharding.enable
                    and s.sharding.stage >= 2 and not c.fsdp_unused),
      "{a} with sharding.stage = {s.sharding.stage} needs torch 2.13 or newer (this is "
      "torch {torch}): {reason}; {fix}",
      "FSDP2 reduces a zero gradient for a parameter a rank did not use only from torch 2.13 "
      "on (FSDPModule.set_reduce_scatter_unused_params)",
      "upgrade torch, use every parameter in forward on every rank, or sharding.stage = 1 "
      "(DDP's pass)",
      {"data_parallel": {"find_unused_parameters": True}, "sharding": {"stage": 3}},
      Context(fsdp_unused=False), lambda s, c: {"torch": _torch_version()}),
)
del C


def conflicts(strategy: Any, context: Context = NO_CONTEXT) -> Iterator[Conflict]:
    """The rows that refuse `strategy` where `context` is known, in the table's order."""
    return (row for row in CONFLICTS if row.applies(strategy, context))


def check(strategy: Any, context: Context = NO_CONTEXT) -> None:
    """Raise the first row that refuses `strategy` (with what `context` knows) as a
    ConfigError with its one-line message."""
    for row in conflicts(strategy, context):
        raise ConfigError(row.message(strategy, context))
