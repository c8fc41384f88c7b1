"""The main job: train a built-in task under a Strategy, with metrics, checkpoints and exact resume.

`train(config, strategy)` runs in every worker (plain `python` for one, `torchrun`
for many). Rank 0 shows progress and writes `OUT/`: `metrics.jsonl`,
`summary.json`, `final.pt`, `strategy.toml`, `run.json`, `checkpoints/`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bigbatch._progress import METRICS_FILE, MetricsWriter, ProgressBar, closing_line, reference
from bigbatch.checkpoint import (
    CHECKPOINT_DIR,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from bigbatch.distributed import World, all_reduce_sum, init_distributed, teardown
from bigbatch.engine import prepare
from bigbatch.errors import ConfigError
from bigbatch.strategy import Strategy
from bigbatch.tasks import Task, get_task
from bigbatch.tasks.sampler import GlobalBatchSampler

RUN_FILE = "run.json"
OUTPUTS = (METRICS_FILE, "summary.json", "final.pt", "strategy.toml", RUN_FILE,
           CHECKPOINT_DIR, "tensorboard")


@dataclass
class TrainConfig:
    """What to train and where to write it (the Strategy says how)."""

    task: str = "mnist1d"
    """Built-in task name (see `bigbatch.tasks.TASKS`)."""
    model: str | None = None
    """Model of the task; None: the task's default."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the task (e.g. `num_samples` for mnist1d, `seq_len` for charlm)."""
    epochs: float | None = None
    """Training length in epochs; None with `steps` None: the task recipe's epochs."""
    steps: int | None = None
    """Training length in optimizer steps (instead of epochs)."""
    seed: int = 0
    """Seeds model init, the data order and every worker's RNGs."""
    out: str = "runs/train"
    """Output directory (rank 0 writes; must be shared storage across nodes to resume)."""
    resume: bool = False
    """Continue from the latest checkpoint in `out`."""
    checkpoint_every: int | None = None
    """Optimizer steps between checkpoints; None: one per epoch. Always one at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    log_every: int | None = None
    """Optimizer steps between metrics lines; None: about ten per epoch."""
    progress: bool = True
    """Show the progress bar (rank 0)."""
    tensorboard: bool | None = None
    """Write TensorBoard event files; None: when tensorboard is importable."""
    eval_batch_size: int = 1024
    """Per-worker batch size of evaluation."""

    def __post_init__(self) -> None:
        if self.epochs is not None and self.steps is not None:
            raise ConfigError("give --epochs or --steps, not both")
        checks = [("epochs", self.epochs, 0), ("steps", self.steps, 1),
                  ("checkpoint_every", self.checkpoint_every, 1), ("log_every", self.log_every, 1),
                  ("keep_checkpoints", self.keep_checkpoints, 1),
                  ("eval_batch_size", self.eval_batch_size, 1)]
        for name, value, low in checks:
            if value is not None and not value >= low or (name == "epochs" and value == 0):
                allowed = "> 0" if name == "epochs" else f">= {low}"
                raise ConfigError(f"{name}={value} is out of range; allowed: {allowed}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _barrier(world: World) -> None:
    if world.is_distributed and dist.is_initialized():
        dist.barrier()


def _broadcast(obj: Any, world: World) -> Any:
    if not world.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any, world: World) -> list[Any]:
    if not world.is_distributed:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def load_task(config: TrainConfig, world: World) -> Task:
    """The task, built on rank 0 first so a data-set cache is generated only once."""
    if world.rank == 0:
        task = get_task(config.task, **config.task_options)
        _barrier(world)
    else:
        _barrier(world)
        task = get_task(config.task, **config.task_options)
    return task


def _fetch(dataset, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    tensors = getattr(dataset, "tensors", None)
    if tensors is None:  # a generic Dataset: collate samples one by one
        from torch.utils.data import default_collate

        batch = default_collate([dataset[int(i)] for i in idx])
    else:
        batch = tuple(t[idx] for t in tensors)
    return tuple(t.to(device, non_blocking=True) for t in batch)


def _eval_batches(dataset, world: World, batch_size: int):
    n = len(dataset)
    lo, hi = world.rank * n // world.world_size, (world.rank + 1) * n // world.world_size
    for start in range(lo, hi, batch_size):
        yield _fetch(dataset, torch.arange(start, min(start + batch_size, hi)), torch.device("cpu"))


def _sync_buffers(module: torch.nn.Module, world: World) -> None:
    # Workers' BatchNorm statistics drift apart between DDP's per-forward broadcasts;
    # evaluate (and save) rank 0's, as the next forward would.
    if world.is_distributed:
        for buf in module.buffers():
            dist.broadcast(buf, src=0)


def prepare_out(config: TrainConfig, world: World) -> Path | None:
    """Resolve the output directory; returns the checkpoint to resume from (or None)."""
    out = Path(config.out)
    ckpt = None
    if world.rank == 0:
        if config.resume:
            ckpt = latest_checkpoint(out)
            if ckpt is None:
                raise ConfigError(f"--resume: no checkpoint in {out / CHECKPOINT_DIR}")
        else:
            for name in OUTPUTS:  # a fresh run replaces an old one's outputs, nothing else
                p = out / name
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
            out.mkdir(parents=True, exist_ok=True)
    ckpt = _broadcast(str(ckpt) if ckpt else None, world)
    return Path(ckpt) if ckpt else None


def plan_run(config: TrainConfig, strategy: Strategy, task: Task, world_size: int,
             rank: int = 0) -> tuple[Any, GlobalBatchSampler, int]:
    """(BatchPlan, this worker's sampler, total optimizer steps); validates the schedule too,
    so a launcher can report every config mistake before starting workers."""
    from bigbatch.schedules import Schedule

    plan = strategy.resolve(world_size)
    sampler = GlobalBatchSampler(len(task.train_set), plan.global_batch_size,
                                 plan.micro_batch_size, world_size, rank, config.seed)
    spe = sampler.steps_per_epoch
    if config.steps is not None:
        total_steps = config.steps
    else:
        epochs = config.epochs if config.epochs is not None else task.recipe(config.model).epochs
        total_steps = max(1, round(epochs * spe))
    Schedule.from_strategy(strategy, plan, total_steps, spe)
    return plan, sampler, total_steps


def evaluate(task: Task, run, world: World, batch_size: int) -> dict[str, float]:
    """Test metrics of rank 0's model; each worker evaluates a shard, the sums are all-reduced."""
    _sync_buffers(run.module, world)
    return task.evaluate(run.module, _eval_batches(task.test_set, world, batch_size),
                         reduce=_summed if world.is_distributed else None)


def _summed(t: torch.Tensor) -> torch.Tensor:
    all_reduce_sum(t)
    return t


def train(config: TrainConfig, strategy: Strategy, world: World | None = None) -> dict[str, Any]:
    """Train `config.task` under `strategy` in this worker; returns the summary (all ranks)."""
    world = world if world is not None else World.from_env()
    owns_group = world.is_distributed and not dist.is_initialized()
    init_distributed(strategy.data_parallel, world)
    try:
        return _train(config, strategy, world)
    finally:
        if owns_group:  # a caller's process group stays theirs
            teardown()


def _train(config: TrainConfig, strategy: Strategy, world: World) -> dict[str, Any]:
    t_start = time.perf_counter()
    out = Path(config.out)
    resume_from = prepare_out(config, world)
    task = load_task(config, world)
    model_name = task.check_model(config.model)
    recipe = task.recipe(model_name)
    plan, sampler, total_steps = plan_run(config, strategy, task, world.world_size, world.rank)
    spe = sampler.steps_per_epoch
    n_epochs = math.ceil(total_steps / spe)
    ckpt_every = config.checkpoint_every or spe
    log_every = config.log_every or max(1, min(50, spe // 10))

    _seed_everything(config.seed)
    model = task.build_model(model_name)
    ckpt = load_checkpoint(resume_from) if resume_from is not None else None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    run = prepare(model, strategy, total_steps=total_steps, steps_per_epoch=spe, world=world,
                  track_stats=True)
    elapsed_before = 0.0
    if ckpt is not None:
        run.load_state_dict(ckpt["engine"])
        sampler.load_state_dict(ckpt["sampler"])
        elapsed_before = float(ckpt.get("wall_time_s", 0.0))
        rngs = ckpt["rng"]
        if len(rngs) == world.world_size:
            set_rng_state(rngs[world.rank])
        else:  # another world size: fresh, still deterministic, streams per worker
            _seed_everything(config.seed * 1000 + world.world_size * 100 + world.rank + run.step)
    else:
        # One stream per worker (dropout masks must differ between workers).
        _seed_everything(config.seed * 1000 + world.rank + 1)

    main = world.is_main
    writer = bar = None
    if main:
        (out / "strategy.toml").write_text(strategy.to_toml())
        (out / RUN_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        writer = MetricsWriter(out, tensorboard=config.tensorboard,
                               resume_step=run.step if ckpt is not None else None)
    bar = ProgressBar(total_steps, run.step, enabled=main, bar=config.progress)
    if ckpt is not None:
        bar.print(f"resuming {out} from step {run.step} (epoch {sampler.epoch}, "
                  f"sample {sampler.position})")
    else:
        bar.print(strategy.overview(world.world_size, steps_per_epoch=spe, total_steps=total_steps))

    timer = {"compute": 0.0, "eval": 0.0, "checkpoint": 0.0}

    def checkpoint() -> None:
        t0 = time.perf_counter()
        rngs = _gather(rng_state(), world)
        if main:
            save_checkpoint(out, run.step, {
                "format": 1,
                "step": run.step,
                "model": run.module.state_dict(),
                "engine": run.state_dict(),
                "sampler": sampler.state_dict(),
                "rng": rngs,
                "world_size": world.world_size,
                "strategy": strategy.to_dict(),
                "config": config.to_dict(),
                "wall_time_s": elapsed_before + time.perf_counter() - t_start,
            }, keep=config.keep_checkpoints)
        timer["checkpoint"] += time.perf_counter() - t0

    def log_eval() -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = evaluate(task, run, world, config.eval_batch_size)
        timer["eval"] += time.perf_counter() - t0
        if main:
            writer.write({"kind": "eval", "step": run.step, "epoch": run.step / spe, **metrics})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            bar.print(f"epoch {run.step / spe:.2f} step {run.step}: test {shown}")
        return metrics

    device = world.device
    loss_acc = torch.zeros(2, dtype=torch.float64, device=device)
    samples_per_s: list[float] = []
    metrics: dict[str, float] | None = None
    t_loop = time.perf_counter()
    t_log, eval_at_log, steps_logged = t_loop, 0.0, 0
    while run.step < total_steps and sampler.epoch < n_epochs:
        for micro_batches in sampler:
            for idx in micro_batches:
                batch = _fetch(task.train_set, idx, device)
                t0 = time.perf_counter()
                with run.micro_step() as ms:  # forward, backward and (k-th) optimizer step
                    loss_sum, count = task.loss(run.model(batch[0]), batch)
                    ms.backward(loss_sum, count=count)
                timer["compute"] += time.perf_counter() - t0
                loss_acc[0] += loss_sum.detach().double()
                loss_acc[1] += count
            steps_logged += 1
            if run.step % log_every == 0 or run.step == total_steps:
                all_reduce_sum(loss_acc)
                dt = time.perf_counter() - t_log - (timer["eval"] - eval_at_log)
                sps = steps_logged * plan.global_batch_size / max(dt, 1e-9)
                samples_per_s.append(sps)
                stats = run.stats
                loss = float(loss_acc[0] / loss_acc[1].clamp_min(1))
                if main:
                    writer.write({"kind": "train", "step": run.step, "epoch": run.step / spe,
                                  "loss": loss, "samples_per_s": sps,
                                  **{k: v for k, v in stats.items() if k != "step"}})
                bar.update(run.step, epoch=run.step / spe, loss=loss, lr=stats["lr"],
                           samples_per_s=sps)
                loss_acc.zero_()
                t_log, eval_at_log, steps_logged = time.perf_counter(), timer["eval"], 0
            if run.step >= total_steps:
                break
            if run.step % ckpt_every == 0 and not sampler.epoch_done:
                checkpoint()
        if sampler.epoch_done:
            metrics = log_eval()
            sampler.next_epoch()
            if run.step < total_steps:
                checkpoint()
    if metrics is None or sampler.position != 0:
        metrics = log_eval()
    checkpoint()
    bar.close()
    # Step time: the loop without evaluation. What is not forward/backward/optimizer in it
    # (data fetching, logging, checkpoints) is the loop's overhead.
    step_time = time.perf_counter() - t_loop - timer["eval"]
    wall = elapsed_before + time.perf_counter() - t_start
    summary = {
        "task": task.name,
        "model": model_name,
        **{f"test_{k}": v for k, v in metrics.items()},
        "metric": task.metric,
        "steps": run.step,
        "epochs": run.step / spe,
        "samples": run.step * plan.global_batch_size,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "k_steps": plan.k_steps,
        "world_size": world.world_size,
        "optimizer": strategy.optimizer_name(),
        "peak_lr": plan.peak_lr,
        "seed": config.seed,
        "wall_time_s": wall,
        "samples_per_s": float(np.median(samples_per_s)) if samples_per_s else None,
        "skipped_steps": run.skipped_steps,
        "time_s": {"steps": step_time, "compute": timer["compute"], "eval": timer["eval"],
                   "checkpoint": timer["checkpoint"]},
        "overhead_share": 1.0 - timer["compute"] / step_time if step_time > 0 else None,
        "reference": reference(recipe, run.step / spe, task.metric),
        "strategy": strategy.to_dict(),
    }
    if main:
        _sync_buffers(run.module, world)
        torch.save(run.module.state_dict(), out / "final.pt")
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        writer.close()
        bar.print(closing_line(summary))
    elif world.is_distributed:
        _sync_buffers(run.module, world)
    return summary

