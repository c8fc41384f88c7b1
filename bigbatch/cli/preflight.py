"""`bigbatch train`'s preflight: every user mistake found before a worker starts or the
output directory is touched (see `bigbatch.cli.main`)."""

from __future__ import annotations

from pathlib import Path

from bigbatch.errors import ConfigError


def _check_option_types(task_name: str, options: dict) -> None:
    """A task option whose default is a number, bool or string takes only that type."""
    import inspect

    from bigbatch.tasks import task_class

    params = inspect.signature(task_class(task_name).__init__).parameters
    for key, value in options.items():
        default = params[key].default if key in params else None
        kind = type(default)
        if kind not in (int, float, bool, str) or isinstance(value, kind) and (
                kind is bool or not isinstance(value, bool)):
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        raise ConfigError(f"--task-opt {key}={value!r}: expected {kind.__name__}, "
                          f"got {type(value).__name__}")


def _check_checkpoint(config, path: Path, ckpt: dict, model, strategy) -> None:
    """On resume: the latest checkpoint must come from this model and fit it."""
    saved = ckpt.get("config") or {}
    sharding = strategy.sharding
    meshed = strategy.tensor_parallel.tensor_parallel_degree > 1 or (
        sharding.enable and sharding.stage >= 2)
    if meshed and not ckpt.get("sharded"):
        raise ConfigError(f"--resume: checkpoint {path.name} holds unsharded optimizer state; "
                          "resume it without [sharding] stage 2-3 or tensor parallelism")
    if ckpt.get("sharded") and sharding.enable and sharding.stage == 1:
        raise ConfigError(f"--resume: checkpoint {path.name} is sharded (DCP); "
                          "ZeRO stage 1 cannot load it: use sharding.stage 2 or 3")
    if config.model is not None and saved.get("model") not in (None, config.model):
        raise ConfigError(f"--resume: checkpoint {path.name} is from model={saved['model']!r}, "
                          f"this run has model={config.model!r}")
    if ckpt.get("sharded"):
        from bigbatch.train.sharded import check_sharded_fits

        was = ((ckpt.get("strategy") or {}).get("tensor_parallel") or {}).get(
            "tensor_parallel_degree", 1)
        now = strategy.tensor_parallel.tensor_parallel_degree
        if was != now:  # the padded vocabulary's shape follows the degree
            raise ConfigError(f"--resume: checkpoint {path.name} was written at "
                              f"tensor_parallel_degree={was}; resume it at the same degree "
                              f"(this run: {now})")
        check_sharded_fits(path, model, shapes=now == 1)
        return
    try:
        model.load_state_dict(ckpt["model"])
    except (KeyError, RuntimeError) as e:
        first = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise ConfigError(f"--resume: checkpoint {path.name} does not fit this model: "
                          f"{first}") from None


def preflight(config, strategy, world_size: int | None):
    """Every user mistake we can find before a worker starts or the output directory is touched:
    output path, task and its options, model, batch arithmetic and schedule (when the world
    size is known), and on resume the checkpoint's task, model and data. Returns the task."""
    from bigbatch.tasks import get_task
    from bigbatch.train.trainer import plan_run

    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    _check_option_types(config.task, config.task_options)
    if strategy.adaptive.policies:  # a bad policy path: now, not in every worker
        from bigbatch.engine.policies import load_policy

        for spec in strategy.adaptive.policies:
            load_policy(spec, strategy)
    path = ckpt = None
    if config.resume:  # before the data: a mismatch must not generate a data set first
        from bigbatch.train.checkpoint import latest_checkpoint, load_checkpoint

        path = latest_checkpoint(out)
        if path is None:
            raise ConfigError(f"--resume: no usable checkpoint in {out / 'checkpoints'}")
        ckpt = load_checkpoint(path)
        saved = ckpt.get("config") or {}
        for key in ("task", "task_options"):
            if key in saved and saved[key] != getattr(config, key):
                raise ConfigError(f"--resume: checkpoint {path.name} is from {key}="
                                  f"{saved[key]!r}, this run has {key}={getattr(config, key)!r}")
    task = get_task(config.task, **config.task_options)  # fills the data cache once, here
    model_name = task.check_model(config.model)
    if world_size is not None:
        plan_run(config, strategy, task, world_size,
                 saved=ckpt.get("engine", {}).get("batch") if ckpt is not None else None)
    model = task.build_model(model_name)
    if ckpt is not None:
        _check_checkpoint(config, path, ckpt, model, strategy)
    pipe = strategy.pipeline
    if pipe.enable and pipe.pp_degree > 1:  # the split, on the throwaway model
        from bigbatch.parallel.pipeline import model_layers, split_layers

        split_layers(model, model_layers(model), pipe.pp_degree * pipe.virtual_stages,
                     pipe.split_points)
    recompute = strategy.recompute
    if recompute.enable and recompute.checkpoints:  # module names exist (throwaway model)
        from bigbatch.engine.recompute import apply_recompute

        apply_recompute(model, list(recompute.checkpoints))
    return task
