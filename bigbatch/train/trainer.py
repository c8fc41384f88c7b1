"""The main job: train a built-in task under a Strategy, with metrics, checkpoints and exact resume.

`train(config, strategy)` runs in every worker (plain `python` for one, `torchrun`
for many). Rank 0 shows progress and writes `OUT/`: `metrics.jsonl`,
`summary.json`, `final.pt`, `strategy.toml`, `run.json`, `checkpoints/` (`lr_find.json`:
`bigbatch.train.lr_phase`), holding the directory's lock for the run and recording
every file it writes (`bigbatch.train.outdir`). A fresh run refuses a directory that holds a run unless
`overwrite`; a resume refuses settings the checkpoint was not trained with
(`bigbatch.train.resume`). SIGTERM, SIGINT or SIGHUP stop the run after the current
step with a checkpoint (`bigbatch.train.signals`).

A checkpoint (every `checkpoint_every` steps, at each epoch end and at the end)
holds the model, the engine's state (optimizer, schedule position, loss scaler,
adaptive state, batch plan), the sampler's position, every worker's RNG states
and the step; resuming from it gives the weights an uninterrupted run would have
(`bigbatch.train.checkpointer` writes and restores it).
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.engine.saving import rng_state
from bigbatch.errors import PolicyStop
from bigbatch.parallel.world import (
    World,
    all_reduce_sum,
    barrier,
    gather,
    init_distributed,
    summed,
    sync_buffers,
    teardown,
)
from bigbatch.train import data
from bigbatch.train.checkpoint import (
    WriteError,
    load_training_checkpoint,
    write_text_atomic,
)
from bigbatch.train.checkpointer import Checkpointer
from bigbatch.train.config import MAX_NONFINITE_SKIPS, TrainConfig
from bigbatch.train.header import header_lines
from bigbatch.train.launch_table import gather_launch, launch_lines
from bigbatch.train.lr_phase import CURVE_FILE, lr_find_phase
from bigbatch.train.nonfinite import NonFiniteGuard, NonFiniteLossError
from bigbatch.train.outdir import RUN_FILE, prepare_out
from bigbatch.train.pipeline_eval import evaluate_pipeline
from bigbatch.train.plan import build_model, fit_warmup, load_task, plan_run
from bigbatch.train.progress import (
    MetricsWriter,
    ProgressBar,
    closing_line,
)
from bigbatch.train.resume import check_resume, schedule_change_line
from bigbatch.train.sharded import load_sharded
from bigbatch.train.signals import Stopped, StopSignals
from bigbatch.train.stopped import write_stopped
from bigbatch.train.summary import run_summary

__all__ = ["RUN_FILE", "TrainConfig", "load_task", "plan_run", "train"]


def train(config: TrainConfig, strategy: Strategy, world: World | None = None) -> dict[str, Any]:
    """Train `config.task` under `strategy` in this worker; returns the summary (all ranks)."""
    world = world if world is not None else World.from_env()
    if strategy.parameter_server.enable:  # server and worker ranks instead of DDP
        from bigbatch.train.ps_job import train_parameter_server

        stop = StopSignals(world)
        with stop.installed():
            return train_parameter_server(config, strategy, world, stop=stop)
    owns_group = world.is_distributed and not dist.is_initialized()
    init_distributed(strategy.data_parallel, world)
    trainer = None
    stop = StopSignals(world)
    held = contextlib.ExitStack()  # the output directory's lock (rank 0)
    try:
        with stop.installed():
            trainer = _Trainer(config, strategy, world, stop, held)
            try:
                summary = trainer.fit()
            except NonFiniteLossError as e:
                trainer.record_stop(str(e), 1)
                raise
        if owns_group:  # and leave together
            barrier(world)
        return summary
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # its frames would keep the trainer alive
        raise
    finally:
        # DDP's reducer must go before the process group it uses: freed after it (with the
        # GIL held), a gloo worker can hang on its own loop thread or abort at exit.
        trainer = None
        gc.collect()
        held.close()
        if owns_group:  # a caller's process group stays theirs
            teardown()


class _Trainer:
    """One worker's training run; rank 0 also logs and writes the outputs."""

    def __init__(self, config: TrainConfig, strategy: Strategy, world: World, stop: StopSignals,
                 held: contextlib.ExitStack):
        self.t_start = time.perf_counter()
        self.config, self.strategy, self.world, self.stop = config, strategy, world, stop
        self.out = Path(config.out)
        self.main = world.is_main
        resume_from, self.files = prepare_out(config, world, held)
        self.task = task = load_task(config, world)
        strategy, warmup_note = fit_warmup(config, strategy, task, world.world_size)
        self.strategy = strategy
        self.model_name = task.check_model(config.model)
        ckpt = (load_training_checkpoint(resume_from, trust=config.trust_checkpoint)
                if resume_from is not None else None)
        saved = ckpt["engine"].get("batch") if ckpt is not None else None
        plan, self.sampler, self.total_steps, spe = plan_run(
            config, strategy, task, world.world_size, world.rank, saved)
        if ckpt is not None:
            check_resume(config, strategy, ckpt, resume_from.name, self.model_name,
                         self.total_steps)

        model = build_model(task, self.model_name, config.seed, strategy)
        if ckpt is not None and "model" in ckpt:
            model.load_state_dict(ckpt["model"])
        self.run = run = prepare(model, strategy, total_steps=self.total_steps,
                                 steps_per_epoch=spe, world=world, track_stats=True, plan=plan,
                                 model_plan=task.model_plan(model),
                                 nan_policy=None)  # `self.guard` below keeps --nan-policy
        self.checkpoints = Checkpointer(self.out, world, self.files,
                                        keep=config.keep_checkpoints,
                                        sharded=run.mesh.degrees.sharded_state, last=resume_from)
        if ckpt is not None and ckpt.get("sharded"):  # DCP reshards to this run's mesh
            load_sharded(resume_from, run.module, run.optimizer)
        if run.adaptive is not None and hasattr(run.adaptive, "limit_batch_size"):
            run.adaptive.limit_batch_size(len(task.train_set))
        self.samples, self.elapsed_before = 0, 0.0
        self.guard = (NonFiniteGuard(config.nan_policy, world, world.device,
                                       MAX_NONFINITE_SKIPS, config.out)
                      if run.scaler is None and run.pipeline is None else None)
        self.lr_found, curve = None, None  # [batch] lr_find: FoundLR as a dict, its curve
        if ckpt is not None:
            self._restore(ckpt)
        else:  # the range test, then per-worker streams (dropout) shared by TP peers
            self.lr_found, curve = lr_find_phase(task, self.model_name, run.module.state_dict(),
                                                 run.clock, strategy, plan, world, config.seed,
                                                 spe)
            data.seed_everything(config.seed * 1000 + run.mesh.data_rank + 1)
        self._follow_plan()
        step_units = self.sampler.steps_per_epoch
        self.ckpt_every = config.checkpoint_every or step_units
        self.log_every = config.log_every or max(1, min(50, step_units // 10))
        self.timer = {"compute": 0.0, "eval": 0.0, "checkpoint": 0.0}
        self.writer = None
        launch = gather_launch(world)  # every rank's place, once
        if self.main:  # every check passed: now the directory is written
            self.files.begin(overwrite=config.overwrite and not config.resume)
            self._write("strategy.toml", strategy.to_toml())
            self._write(RUN_FILE, json.dumps({**config.to_dict(), "launch": launch},
                                             indent=2) + "\n")
            if curve is not None:
                self._write(CURVE_FILE, curve)
            self.writer = MetricsWriter(self.out, tensorboard=config.tensorboard,
                                        resume_step=run.step if ckpt is not None else None,
                                        files=self.files)
        self.bar = ProgressBar(self.total_steps, int(run.progress), enabled=self.main,
                               bar=config.progress)
        for line in header_lines(run, strategy, self.out, self.sampler, saved, spe,
                                 self.total_steps, self.lr_found, warmup_note,
                                 resumed=ckpt is not None, data_note=task.data_note(),
                                 fleet=config.fleet, launch=launch_lines(launch)):
            self.bar.print(line)
        if ckpt is not None and self.main:
            extended = schedule_change_line(run.clock, ckpt)
            if extended is not None:
                self.bar.print(extended)

    def _restore(self, ckpt: dict) -> None:
        self.checkpoints.restore(ckpt, self.run, self.sampler, self.config.seed)
        self.samples = int(ckpt.get("samples", 0))
        self.lr_found = ckpt.get("lr_find")  # the peak itself is in the clock's state
        self.elapsed_before = float(ckpt.get("wall_time_s", 0.0))
        if self.guard is not None:
            self.guard.skipped = int(ckpt.get("nonfinite_skipped_steps", 0))

    def _follow_plan(self) -> None:
        """Make the sampler hand out the engine's current batch (policies change it)."""
        plan, s = self.run.plan, self.sampler
        if (plan.global_batch_size, plan.micro_batch_size) != (s.global_batch_size,
                                                               s.micro_batch_size):
            s.set_batch(plan.global_batch_size, plan.micro_batch_size)
        if self.run.micro_batch_sizes != s.shares:
            s.set_shares(self.run.micro_batch_sizes)

    def _policy_requests(self) -> None:
        """Write what the policies recorded; checkpoint, or stop after one, when asked."""
        policies = self.run.policies
        for record in policies.take_records():
            if self.main:
                self.writer.write(record)
        self._follow_plan()
        if policies.stop is not None:
            message, status = policies.stop
            if policies.relaunch and self.main:
                self.writer.write({"kind": "relaunch", "step": self.run.step,
                                   "set": dict(policies.relaunch), "reason": message})
            self.checkpoint()
            if self.main:
                write_stopped(self.out, message, status, self.run.step, self.files,
                              relaunch=policies.relaunch)
            self.bar.close()
            raise PolicyStop(message, status)
        if policies.checkpoint_requested:
            policies.checkpoint_requested = False
            self.checkpoint()

    def record_stop(self, message: str, status: int) -> None:
        """Rank 0: say in `OUT/stopped.json` why the run ended early (`bigbatch monitor`
        shows it), without hiding the error that ended it."""
        if not self.main:
            return
        try:
            write_stopped(self.out, message, status, self.run.step, self.files)
        except OSError as e:
            self.bar.print(f"note: could not record the stop in {self.out} ({e})")

    def _write(self, name: str, text: str) -> None:
        """Rank 0: the output file `name` (recorded first, written atomically)."""
        path = self.out / name
        self.files.add(path)
        try:
            write_text_atomic(path, text)
        except OSError as e:
            raise WriteError(f"writing {path} failed ({e.strerror or e})") from e

    def _stop_if_asked(self) -> None:
        """At a step boundary (every worker): on a signal, checkpoint here and stop."""
        signum = self.stop.poll()
        if signum is None:
            return
        if not self.checkpoints.holds(self.run.step, self.samples):
            self.checkpoint()
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        raise Stopped(signum, self.run.step, self.checkpoints.last)

    @property
    def epoch(self) -> float:
        s = self.sampler
        return s.epoch + s.position / max(1, s.steps_per_epoch * s.global_batch_size)

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        run, sampler, device = self.run, self.sampler, self.world.device
        loss_acc = torch.zeros(2, dtype=torch.float64, device=device)
        step_loss = torch.zeros(2, dtype=torch.float64, device=device)
        self.samples_per_s: list[float] = []
        metrics: dict[str, float] | None = None
        t_loop = time.perf_counter()
        t_log, eval_at_log, samples_at_log = t_loop, 0.0, self.samples
        run.policies.before_train()
        while not run.done:
            run.policies.before_epoch(sampler.epoch + 1)
            self._policy_requests()
            for micro_batches in sampler:
                skipped = False
                if run.pipeline is not None:  # the k micro-batches go through it together
                    idx = torch.cat(micro_batches)
                    batch = data.fetch(self.task.train_set, idx, device)
                    t0 = time.perf_counter()
                    loss_sum, count = run.pipeline_step(batch[0], batch[1], self._stage_loss)
                    self.timer["compute"] += time.perf_counter() - t0
                    step_loss[0] += loss_sum
                    step_loss[1] += count
                    micro_batches = []
                for idx in micro_batches:
                    batch = data.fetch(self.task.train_set, idx, device)
                    t0 = time.perf_counter()
                    with run.micro_step() as ms:  # forward, backward, (k-th) optimizer step
                        loss_sum, count = self.task.loss(run.model(batch[0]), batch)
                        # The guard may stop the run, or have every worker skip this step.
                        skipped = (self.guard is not None
                                   and self.guard.should_skip(ms, loss_sum, run.step + 1))
                        if skipped:
                            ms.skip()
                        else:
                            ms.backward(loss_sum, count=count)
                    self.timer["compute"] += time.perf_counter() - t0
                    step_loss[0] += loss_sum.detach().double()
                    step_loss[1] += count
                self.samples += sampler.global_batch_size
                if not skipped:  # a skipped step's loss stays out of the logged mean
                    loss_acc += step_loss
                step_loss.zero_()
                if skipped:
                    if not sampler.epoch_done:
                        self._stop_if_asked()
                    continue
                if run.step % self.log_every == 0 or run.done:
                    dt = time.perf_counter() - t_log - (self.timer["eval"] - eval_at_log)
                    self._log_train(loss_acc, (self.samples - samples_at_log) / max(dt, 1e-9))
                    t_log, eval_at_log, samples_at_log = (time.perf_counter(),
                                                          self.timer["eval"], self.samples)
                self._policy_requests()
                if run.done:
                    break
                every = self.config.eval_every
                if every and run.step % every == 0 and not sampler.epoch_done:
                    metrics = self.evaluate()
                if run.step % self.ckpt_every == 0 and not sampler.epoch_done:
                    self.checkpoint()
                if not sampler.epoch_done:
                    self._stop_if_asked()
            if sampler.epoch_done:
                metrics = self.evaluate()
                run.policies.after_epoch(sampler.epoch + 1)
                self._policy_requests()
                sampler.next_epoch()
                if not run.done:
                    self.checkpoint()
                    self._stop_if_asked()
        if metrics is None or sampler.position != 0:
            metrics = self.evaluate()
        run.policies.after_train()
        self._policy_requests()
        self.checkpoint()
        self.bar.close()
        # Step time: the loop without evaluation. What is not forward/backward/optimizer in it
        # (data fetching, logging, checkpoints) is the loop's overhead.
        return self._finish(metrics, time.perf_counter() - t_loop - self.timer["eval"])

    def _stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.task.loss(output, (None, target))

    def _log_train(self, loss_acc: torch.Tensor, samples_per_s: float) -> None:
        run = self.run
        all_reduce_sum(loss_acc)
        loss = float(loss_acc[0] / loss_acc[1].clamp_min(1))
        loss_acc.zero_()
        self.samples_per_s.append(samples_per_s)
        stats = run.stats
        if self.main:
            self.writer.write({"kind": "train", "step": run.step, "epoch": self.epoch,
                               "loss": loss, "samples_per_s": samples_per_s,
                               "global_batch_size": run.plan.global_batch_size,
                               **{k: v for k, v in stats.items() if k != "step"}})
        self.bar.update(min(run.progress, self.total_steps), epoch=self.epoch, loss=loss,
                        lr=stats["lr"], samples_per_s=samples_per_s)

    def evaluate(self) -> dict[str, float]:
        """Test metrics of rank 0's model; each worker evaluates a shard, sums are all-reduced."""
        t0 = time.perf_counter()
        run = self.run
        run.synchronize()  # local SGD: evaluate the workers' average
        sync_buffers(run.module, self.world, run.mesh.dp_group)
        batches = data.shard_batches(self.task.test_set, run.mesh.data_rank,
                                     run.mesh.data_degree, self.config.eval_batch_size)
        group = run.mesh.dp_group
        if run.pipeline is not None:
            metrics = evaluate_pipeline(self.task, run, batches, self.config.eval_batch_size)
        else:
            metrics = self.task.evaluate(
                run.module, batches,
                reduce=(lambda t: summed(t, group)) if self.world.is_distributed else None)
        self.timer["eval"] += time.perf_counter() - t0
        if self.main:
            step = self.run.step
            self.writer.write({"kind": "eval", "step": step, "epoch": self.epoch, **metrics})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            self.bar.print(f"epoch {self.epoch:.2f} step {step}: test {shown}")
        return metrics

    def checkpoint(self) -> None:
        t0 = time.perf_counter()
        rngs = gather(rng_state(), self.world)
        with self.stop.writing():  # a second Ctrl-C waits for the file to be whole
            self.checkpoints.save(self.run, self.sampler, self.samples, rngs, self._counters)
        self.timer["checkpoint"] += time.perf_counter() - t0

    def _counters(self) -> dict[str, Any]:
        """The trainer's part of a checkpoint (taken as it is written)."""
        return {"strategy": self.strategy.to_dict(), "config": self.config.to_dict(),
                "wall_time_s": self.elapsed_before + time.perf_counter() - self.t_start,
                "nonfinite_skipped_steps": self.guard.skipped if self.guard else 0,
                "lr_find": self.lr_found, "total_steps": self.total_steps}

    def _finish(self, metrics: dict[str, float], step_time: float) -> dict[str, Any]:
        run, plan, task = self.run, self.run.plan, self.task
        timer = self.timer
        summary = run_summary(
            task=task, model=self.model_name, metrics=metrics, steps=run.step,
            epochs=self.epoch, samples=self.samples, plan=plan, budget_epochs=None
            if self.config.steps else self.config.epochs or task.recipe(self.model_name).epochs,
            world_size=self.world.world_size, strategy=self.strategy, seed=self.config.seed,
            wall_time_s=self.elapsed_before + time.perf_counter() - self.t_start,
            samples_per_s=float(np.median(self.samples_per_s)) if self.samples_per_s else None,
            skipped_steps=run.skipped_steps,
            nonfinite_skipped_steps=self.guard.skipped if self.guard else 0,
            batch_size_changes=list(run.batch_size_changes),
            time_s={"steps": step_time, "compute": timer["compute"], "eval": timer["eval"],
                    "checkpoint": timer["checkpoint"]},
            overhead_share=1.0 - timer["compute"] / step_time if step_time > 0 else None,
            lr_find=self.lr_found, peak_lr=self.lr_found["peak_lr"] if self.lr_found else None)
        sync_buffers(run.module, self.world, run.mesh.dp_group)
        with self.stop.writing():
            self.checkpoints.save_final(run)
        if self.main:
            self._write("summary.json", json.dumps(summary, indent=2) + "\n")
            self.writer.close()
            self.bar.result(closing_line(summary))
        return summary
