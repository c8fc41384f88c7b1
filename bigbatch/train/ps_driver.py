"""Server 0's main thread in parameter-server mode: between steps it logs, evaluates
and checkpoints, then releases the step's replies (see `bigbatch.train.ps_job`).

A step is one global batch of gradients applied, in both modes (as `--steps`, the
metrics, the checkpoints and the summary count it): in sync mode one server update,
in async mode as many updates as there are workers (`per`). Logs, evaluations and
checkpoints happen at step boundaries only, a stop on a signal included: an async
server applies the pushes that complete the step in progress first. In geo mode a server
update is a round of up to geo_k_steps local steps; server 0 keeps a copy of worker 0's
engine state (its schedule position, optimizer state) as its own `run`, so that the step,
the LR and the end of the run are the workers', and logs, evaluates and checkpoints at the
first round boundary at or after each interval."""

from __future__ import annotations

import copy
import dataclasses
import json
import queue
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bigbatch.train import data
from bigbatch.train.checkpoint import (
    atomic_save,
    save_checkpoint,
    write_text_atomic,
)
from bigbatch.train.launch_table import launch_lines
from bigbatch.train.outdir import RUN_FILE
from bigbatch.train.progress import MetricsWriter, ProgressBar, closing_line
from bigbatch.train.signals import Stopped
from bigbatch.train.summary import run_summary

__all__ = ["Driver"]

_POLL_S = 0.2
"""How often server 0, waiting for gradients, looks for a stop signal."""
_STOP_TRIES = 16
"""Step boundaries an async server tries to stop exactly at before it stops anyway."""


class Driver:
    """Logs, evaluation and checkpoints of a parameter-server run, on server 0."""

    def __init__(self, job: Any, run: Any, server: Any) -> None:
        self.t_start = time.perf_counter()
        self.job, self.run, self.server = job, run, server
        cfg, plan = job.config, job.plan
        self.sync = job.cfg.mode == "sync"
        self.geo = job.cfg.mode == "geo"
        self.rounds = self.sync or self.geo
        """Every server steps at the same versions (a checkpoint waits for them)."""
        per = job.workers if job.cfg.mode == "async" else 1
        self.per = per  # server updates per step (geo: per round, see `_position`)
        self.batch = plan.global_batch_size // per
        self.steps_per_epoch = job.spe * per
        self.ckpt_every = (cfg.checkpoint_every * per if cfg.checkpoint_every
                           else self.steps_per_epoch)
        self.log_every = (cfg.log_every or max(1, min(50, job.spe // 10))) * per
        self.eval_every = cfg.eval_every * per if cfg.eval_every else None
        saved = job.ckpt or {}
        self.samples = int(saved.get("samples", 0))
        self.elapsed_before = float(saved.get("wall_time_s", 0.0))
        self.worker_states: dict[int, Any] = dict((job.saved or {}).get("worker_states", {}))
        self.eval_model = copy.deepcopy(job.model)
        self._loss = [0.0, 0.0]
        self._stale: list[int] = []
        self._rates: list[float] = []
        self._t_log, self._samples_log = time.perf_counter(), self.samples
        self.signal: int | None = None
        """A stop signal seen here or by a worker (its pushes carry it)."""
        self.saved: int | None = saved.get("step")
        """The step the last checkpoint holds (the resumed one's, before the first save)."""
        self.saved_path: Path | None = job.resume_from
        self._stop_tries = 0
        self._pos = self._position(server.version)
        server.is_done = lambda: run.done
        out = Path(cfg.out)
        job.files.begin(overwrite=cfg.overwrite and not cfg.resume)
        write_recorded(job.files, out / "strategy.toml", job.strategy.to_toml())
        write_recorded(job.files, out / RUN_FILE,
                       json.dumps({**cfg.to_dict(), "launch": job.launch}, indent=2) + "\n")
        self.writer = MetricsWriter(out, tensorboard=cfg.tensorboard, files=job.files,
                                    resume_step=job.ckpt["step"] if job.ckpt is not None else None)
        # The checkpoint's step, not run.step: the workers may have pushed a step already.
        self.bar = ProgressBar(job.total_steps, int(run.progress // per), enabled=True,
                               bar=cfg.progress)
        for line in launch_lines(job.launch) if job.launch is not None else []:
            self.bar.print(line)
        if (note := job.task.data_note()) is not None:
            self.bar.print(note)
        if job.ckpt is not None:
            self.bar.print(f"resuming {out} from step {job.ckpt['step']} ({job.cfg.mode} parameter "
                           f"server, {job.servers} server(s), {job.workers} worker(s))")
        else:
            self.bar.print(job.strategy.overview(job.world.world_size,
                                                 steps_per_epoch=job.spe,
                                                 total_steps=job.total_steps))
            if job.warmup_note is not None:
                self.bar.print(job.warmup_note)

    def wall_time(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start

    def samples_per_s(self) -> float | None:
        return float(statistics.median(self._rates)) if self._rates else None

    def _own_signal(self) -> int | None:
        self.signal = self.signal or (self.job.stop.requested if self.job.stop else None)
        return self.signal

    def _next_event(self) -> tuple[int, list[Any], Any] | None:
        """The next applied update's (version, pushes, release); None when a stop signal
        came while none arrives (a worker is gone: the step cannot complete). Raises
        TimeoutError when none arrives within the timeout."""
        deadline = time.monotonic() + self.job.timeout
        while True:
            try:
                return self.server.events.get(timeout=min(_POLL_S, self.job.timeout))
            except queue.Empty:
                pass
            if self._own_signal() is not None:
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"parameter server: no gradient arrived within "
                                   f"data_parallel.timeout_s={self.job.timeout:g} (timed out)")

    def _position(self, version: int) -> int:
        """Where the run is, in the units of the intervals: server updates (steps times
        `per`), geo: steps (worker 0's, as server 0's `run` holds them)."""
        return self.run.step if self.geo else version

    def _step_of(self, version: int) -> int:
        return self.run.step if self.geo else version // self.per

    def loop(self) -> dict[str, Any]:
        run, server = self.run, self.server
        while True:
            event = self._next_event()
            if event is None:  # stopped while no step is in progress
                return self._stop(None)
            version, pushes, release = event
            self._take(version, pushes)
            before, self._pos = self._pos, self._position(version)

            def due(every: int | None, before: int = before) -> bool:
                return bool(every) and self._pos // every > before // every

            if self._own_signal() is not None and not run.done and version % self.per == 0:
                # Async: stop here unless a later push is applied already (then at the next
                # boundary; after a few tries, wherever the updates are).
                self._stop_tries += 1
                if server.finish(at=version) or self._stop_tries > _STOP_TRIES:
                    self._log(self._pos)
                    return self._stop(release)
            with server.lock:  # no step is applied once done, so no event can follow
                last = run.done and server.events.empty()
            if due(self.log_every) or last:
                self._log(self._pos)
            if last:
                server.finish()  # the replies now say stop
                release()
                break
            if not run.done:
                if due(self.eval_every):
                    self.evaluate(version)
                if due(self.steps_per_epoch):
                    self.evaluate(version)
                    self.checkpoint()
                elif due(self.ckpt_every):
                    self.checkpoint()
            release()
        metrics = self.evaluate(server.version)  # the last step's events skip the per-epoch one
        self.checkpoint()
        with server.lock:
            at = run.step if self.sync else server.version if self.geo else 0
            weights = {k: v.clone() for k, v in self.job.full_model(server, at).items()}
        summary = summary_of(self.job, run, server, self, metrics)
        self.bar.close()
        write_outputs(self.job, summary, weights, self.writer, self.bar)
        return summary

    def _stop(self, release: Any) -> dict[str, Any]:
        """A signal: checkpoint this step (every server's state, every worker's position),
        tell the workers to stop, and raise `Stopped` on the way out (`Job.stopped`).
        Between steps (`release` None: a worker is gone mid-step) the last completed step
        is checkpointed, unless the last checkpoint holds it already."""
        self.server.finish()  # no later push is applied; its reply says stop
        step = self._step_of(self.server.version)
        if self.server.version % self.per == 0 and self.saved != step:
            step, path = self.checkpoint()
        else:
            step, path = self.saved, self.saved_path
        if release is not None:
            release()
        self.bar.close()
        self.writer.close()
        self.job.stopped = Stopped(self.signal, step, path)
        return {"stopped": self.signal, "step": step}

    def _take(self, version: int, pushes: list[Any]) -> None:
        before = self.run.step
        for p in pushes:
            if p.extra is not None and p.extra.get("signal"):
                self.signal = self.signal or int(p.extra["signal"])
            self._loss[0] += p.loss
            self._loss[1] += p.count
            if p.extra is not None:
                self.worker_states[p.worker] = {"sampler": p.extra["sampler"],
                                                "rng": p.extra["rng"]}
                if self.geo:  # the worker's own optimizer and what it kept of its progress
                    self.worker_states[p.worker].update(engine=p.extra["geo_engine"],
                                                        kept=p.extra["geo_kept"])
                    if p.worker == 0:
                        self.run.load_state_dict(p.extra["geo_engine"])
                if "buffers" in p.extra:  # worker 0's BatchNorm statistics, as DDP keeps them
                    buffers = dict(self.job.model.named_buffers())
                    with torch.no_grad():
                        for k, v in p.extra["buffers"].items():
                            buffers[k].copy_(v)
            if not self.rounds:
                self._stale.append(version - 1 - p.version)
        if self.geo:  # every worker took the round's local steps, one global batch each
            self.samples += self.job.plan.global_batch_size * (self.run.step - before)
        else:
            self.samples += self.batch

    def _log(self, step: int) -> None:
        now = time.perf_counter()
        rate = (self.samples - self._samples_log) / max(now - self._t_log, 1e-9)
        self._rates.append(rate)
        self._t_log, self._samples_log = now, self.samples
        loss = self._loss[0] / max(self._loss[1], 1.0)
        self._loss = [0.0, 0.0]
        stats = self.run.stats
        record = {"kind": "train", "step": step // self.per, "epoch": self.epoch, "loss": loss,
                  "samples_per_s": rate, "global_batch_size": self.job.plan.global_batch_size,
                  **{k: v for k, v in stats.items() if k != "step"}}
        if not self.rounds:
            record.update(staleness_mean=statistics.mean(self._stale) if self._stale else 0.0,
                          staleness_max=max(self._stale, default=0),
                          dropped=self.server.dropped)
            self._stale = []
        self.writer.write(record)
        self.bar.update(min(self.run.progress // self.per, self.job.total_steps),
                        epoch=self.epoch, loss=loss, lr=stats["lr"], samples_per_s=rate)

    @property
    def epoch(self) -> float:
        return self.samples / (self.job.spe * self.job.plan.global_batch_size)

    def evaluate(self, version: int) -> dict[str, float]:
        """Test metrics of the model at server `version` (a step boundary)."""
        with self.server.lock:
            weights = self.job.full_model(self.server, version if self.rounds else 0)
            self.eval_model.load_state_dict(weights)
        step = self._step_of(version)
        job = self.job
        batches = data.shard_batches(job.task.test_set, 0, 1, job.config.eval_batch_size)
        metrics = job.task.evaluate(self.eval_model, batches)
        self.writer.write({"kind": "eval", "step": step, "epoch": self.epoch, **metrics})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self.bar.print(f"epoch {self.epoch:.2f} step {step}: test {shown}")
        return metrics

    def checkpoint(self) -> tuple[int, Path]:
        """Save every server's state now; (its step, its path)."""
        payload = self.job.checkpoint_payload(self.run, self.server, self)
        path = save_checkpoint(Path(self.job.config.out), payload["step"], payload,
                               keep=self.job.config.keep_checkpoints, files=self.job.files)
        self.saved, self.saved_path = payload["step"], path
        return payload["step"], path


def write_recorded(files: Any, path: Path, text: str) -> None:
    """An output file, recorded in the run's file list first, written atomically."""
    files.add(path)
    write_text_atomic(path, text)


def write_outputs(job: Any, summary: dict[str, Any], weights: dict[str, torch.Tensor],
                  writer: MetricsWriter, bar: ProgressBar) -> None:
    out = Path(job.config.out)
    job.files.add(out / "final.pt")
    atomic_save(weights, out / "final.pt")
    write_recorded(job.files, out / "summary.json", json.dumps(summary, indent=2) + "\n")
    writer.close()
    bar.result(closing_line(summary))


def summary_of(job: Any, run: Any, server: Any, driver: Any,
               metrics: dict[str, float]) -> dict[str, Any]:
    plan, task = job.plan, job.task
    hist = dict(sorted(server.staleness.items()))
    return run_summary(
        task=task, model=task.check_model(job.config.model), metrics=metrics,
        steps=run.step // driver.per,
        epochs=driver.samples / (job.spe * plan.global_batch_size), samples=driver.samples,
        plan=dataclasses.replace(plan, peak_lr=run.plan.peak_lr),
        world_size=job.world.world_size, strategy=job.strategy, seed=job.config.seed,
        wall_time_s=driver.wall_time(), samples_per_s=driver.samples_per_s(),
        parameter_server={"mode": job.cfg.mode, "servers": job.servers, "workers": job.workers,
                          "staleness_histogram": hist, "dropped": server.dropped})
