"""`bigbatch train`'s preflight: every user mistake found before a worker starts or the
output directory is touched (see `bigbatch.cli.main`). It reads and never writes (the
data cache aside: generating it once here keeps the workers from racing to)."""

from __future__ import annotations

from pathlib import Path

from bigbatch.config.compat import Context, check
from bigbatch.errors import ConfigError


def _check_checkpoint(config, path: Path, ckpt: dict, model, strategy) -> None:
    """On resume: the latest checkpoint's weights fit this model (and this layout)."""
    sharding = strategy.sharding
    meshed = strategy.tensor_parallel.tensor_parallel_degree > 1 or (
        sharding.enable and sharding.stage >= 2) or (
        strategy.pipeline.enable and strategy.pipeline.pp_degree > 1)
    if meshed and not ckpt.get("sharded"):
        raise ConfigError(f"--resume: checkpoint {path.name} holds unsharded optimizer state; "
                          "resume it without [sharding] stage 2-3, tensor or pipeline "
                          "parallelism")
    if ckpt.get("sharded"):
        if sharding.enable and sharding.stage == 1:
            raise ConfigError(f"--resume: checkpoint {path.name} is sharded (DCP); "
                              "ZeRO stage 1 cannot load it: use sharding.stage 2 or 3")
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


def wasteful_settings(nproc: int, strategy, cuda: bool, devices: int) -> list[str]:
    """Settings that run, but waste the machine: a line each, for the launcher to warn with
    (`devices`: GPUs with `cuda`, else the CPU cores this process may use)."""
    lines = []
    if nproc > devices:
        kind = "GPU(s)" if cuda else "CPU cores"
        lines.append(f"--nproc {nproc} starts {nproc} workers on {devices} {kind}: they take "
                     f"turns on them, and every step is slower than with --nproc {devices} "
                     "(--nproc auto)")
    if strategy.amp.enable and strategy.amp.dtype == "float16" and not cuda:
        lines.append("amp.dtype=float16 on a CPU runs about 10x slower than bfloat16 (CPUs "
                     "have no fast float16 kernels): --set amp.dtype=bfloat16")
    return lines


def preflight(config, strategy, world_size: int | None, *, checks_out: bool = True):
    """Every user mistake we can find before a worker starts or the output directory is
    touched: output path and lock, task and its options, model, devices, batch arithmetic
    and schedule (when the world size is known), the adaptive settings, and on resume the
    checkpoint (readable, same task, data, model and settings, a length that extends it),
    else whether `--out` already holds a run. `checks_out=False` (workers but rank 0)
    leaves the output directory to rank 0. Returns the task."""
    from bigbatch.engine import adaptive
    from bigbatch.tasks import check_options, get_task, task_class
    from bigbatch.train.outdir import check_fresh, check_out_path
    from bigbatch.train.plan import fit_warmup, plan_run

    out = Path(config.out)
    if checks_out:
        from bigbatch.train.lock import check_unlocked

        check_out_path(out)
        check_unlocked(out)
    cls = task_class(config.task)
    if strategy.adaptive.policies:  # a bad policy path: now, not in every worker
        from bigbatch.engine.policies import load_policy

        for spec in strategy.adaptive.policies:
            load_policy(spec, strategy)
    path = ckpt = None
    if config.resume:  # first: another task's options or data must not be checked or made
        from bigbatch.train.checkpoint import load_training_checkpoint, resume_checkpoint
        from bigbatch.train.resume import check_resume

        path = resume_checkpoint(out, trust=config.trust_checkpoint)
        ckpt = load_training_checkpoint(path, trust=config.trust_checkpoint)
        check_resume(config, strategy, ckpt, path.name, cls.default_model)
        if world_size is not None:  # parameter-server checkpoints need the same ranks
            from bigbatch.train.ps_job import check_resume as check_ps_resume

            check_ps_resume(ckpt, strategy, world_size, path.name)
    options = check_options(config.task, config.task_options)
    if config.model is not None and config.model not in cls.models:
        raise ConfigError(f"model={config.model!r} is not a model of task {config.task!r}; "
                          f"valid: {', '.join(cls.models)}")
    import torch

    from bigbatch.parallel.sharding import fsdp_reduces_unused

    # Settings that need CUDA, or a newer torch: refused here, not in every worker.
    check(strategy, Context(cuda=torch.cuda.is_available(), world_size=world_size,
                            fsdp_unused=fsdp_reduces_unused()))
    task = get_task(config.task, **options)  # fills the data cache once, here
    model_name = task.check_model(config.model)
    saved = ckpt.get("engine", {}).get("batch") if ckpt is not None else None
    if world_size is not None:
        strategy = fit_warmup(config, strategy, task, world_size)[0]
        plan, _, total_steps, _ = plan_run(config, strategy, task, world_size, saved=saved)
        check(strategy, Context(run=True))  # what a run of this strategy cannot do
        adaptive.check(strategy, plan)
        if ckpt is not None:
            check_resume(config, strategy, ckpt, path.name, model_name, total_steps)
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
    if checks_out and not config.resume:
        check_fresh(out, config.overwrite)  # last: a mistake above is the one to report
    return task
