"""The main job in parameter-server mode (`[parameter_server]`): ranks 0..S-1 serve, the
other W ranks compute (`bigbatch.parallel.parameter_server` has the protocol).

`bigbatch train --nproc 3 --set parameter_server.servers=1` runs 1 server and 2 workers;
the batch is split over the W workers (`global = micro x k_steps x W`). Each server runs
the engine's step (the strategy's optimizer, LR schedule and trust ratios) on the tensors
it owns. Server 0 owns the outputs: between steps it logs, evaluates the whole model
(the other servers' tensors fetched, worker 0's BatchNorm buffers, as DDP keeps rank
0's) and writes checkpoints that hold every server's state and every worker's data
position and RNG; `--resume` continues from them. In sync mode a resumed run equals an
uninterrupted one; in async mode which gradients land when is timing, so is its resume.

In geo mode (Fleet's GEO-SGD; the worker's loop is `bigbatch.train.ps_geo`) the workers
run the engine: each steps its own copy of the model with the strategy's optimizer and
schedule (a step is one global batch, every worker one local step, as in local SGD), and
every `geo_k_steps` steps exchanges deltas with the servers, which only add them. A checkpoint holds each worker's engine state and the
progress it kept, so a resumed geo run equals an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from bigbatch.config.elastic import BatchState, configured_sizes
from bigbatch.config.sections import ParameterServerConfig
from bigbatch.engine import prepare
from bigbatch.engine.saving import rng_state, set_rng_state
from bigbatch.errors import ConfigError
from bigbatch.parallel import parameter_server as ps
from bigbatch.parallel.world import World, barrier, init_distributed, teardown
from bigbatch.train import data
from bigbatch.train.checkpoint import (
    CHECKPOINT_FORMAT,
    load_training_checkpoint,
)
from bigbatch.train.launch_table import gather_launch
from bigbatch.train.outdir import prepare_out
from bigbatch.train.plan import build_model, fit_warmup, load_task, plan_run
from bigbatch.train.ps_driver import Driver
from bigbatch.train.ps_geo import geo_work
from bigbatch.train.signals import Stopped

__all__ = ["check_resume", "train_parameter_server"]


def check_resume(ckpt: dict, strategy: Any, world_size: int, name: str) -> None:
    """A checkpoint resumes in parameter-server mode only from one, on as many servers and
    workers (each server's optimizer state is its shard's)."""
    saved = ckpt.get("parameter_server")
    on = strategy.parameter_server.enable
    if on != (saved is not None):
        was = "in" if saved is not None else "without"
        raise ConfigError(f"--resume: checkpoint {name} was written {was} parameter-server mode; "
                          f"resume it {was} [parameter_server]")
    if on:
        s = strategy.parameter_server.servers
        if (saved["servers"], saved["workers"]) != (s, world_size - s):
            raise ConfigError(
                f"--resume: checkpoint {name} has {saved['servers']} server(s) and "
                f"{saved['workers']} worker(s); this run has {s} and {world_size - s} "
                f"(use --nproc {saved['servers'] + saved['workers']} and "
                f"parameter_server.servers={saved['servers']})")


def train_parameter_server(config: Any, strategy: Any, world: World,
                           *, slow_worker: tuple[int, float] | None = None,
                           stop: Any = None) -> dict[str, Any]:
    """Run this rank's part; returns the summary on server 0, a short record elsewhere.

    The output directory follows the main job's rules (`bigbatch.train.outdir`): server 0
    holds its lock and records what it writes. `stop` (`bigbatch.train.signals.StopSignals`,
    installed by the caller): on SIGTERM, SIGINT or SIGHUP at server 0 or at a worker,
    server 0 checkpoints after the step in progress, the workers are told to stop, and
    every rank raises `Stopped` once the others are done. `slow_worker` (index, seconds): that worker
    sleeps after each push (benchmarks).
    """
    owns_group = world.is_distributed and not dist.is_initialized()
    init_distributed(strategy.data_parallel, world)
    rpc_on = False
    held = contextlib.ExitStack()  # the output directory's lock (rank 0)
    try:
        resume_from, files = prepare_out(config, world, held)
        task = load_task(config, world)
        strategy, warmup_note = fit_warmup(config, strategy, task, world.world_size)
        ckpt = (load_training_checkpoint(resume_from, trust=config.trust_checkpoint)
                if resume_from is not None else None)
        if ckpt is not None:
            check_resume(ckpt, strategy, world.world_size, resume_from.name)
        saved = ckpt["engine"]["batch"] if ckpt is not None else None
        plan, sampler, total_steps, spe = plan_run(config, strategy, task, world.world_size,
                                                   world.rank, saved)
        model = build_model(task, task.check_model(config.model), config.seed, strategy)
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
        cfg = strategy.parameter_server
        timeout = strategy.data_parallel.timeout_s
        ps.start_rpc(world.rank, world.world_size, cfg.servers, timeout, _rpc_init_method())
        rpc_on = True
        job = _Job(config, strategy, task, model, plan, total_steps, spe, ckpt, world)
        job.files, job.stop, job.warmup_note = files, stop, warmup_note
        job.launch = gather_launch(world)  # every rank's place, once
        if world.rank < cfg.servers:
            result = job.serve(resume_from)
        else:
            result = job.work(sampler, slow_worker)
        rpc_on = False
        _leave_rpc(timeout)
        if job.stopped is not None:
            raise job.stopped
        return result
    finally:
        if rpc_on:
            _leave_rpc(timeout)
        if owns_group:
            teardown()
        held.close()


_RPC_SCHEME = "bigbatch-attempt"


def _attempt_rendezvous(url: str, **kwargs: Any) -> Any:
    """env://, with keys that are this torchrun attempt's own: the agent's store outlives a
    restart of the worker group (`--max-restarts`), and RPC would read the dead attempt's
    keys as this one's (`bigbatch.parallel.world` does the same for the process group)."""
    from datetime import timedelta
    from urllib.parse import parse_qs, urlparse

    query = parse_qs(urlparse(url).query)
    rank, size = int(query["rank"][0]), int(query["world_size"][0])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=False, timeout=timedelta(seconds=300))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    yield dist.PrefixStore(f"bigbatch/attempt_{attempt}/rpc/", store), rank, size


def _rpc_init_method() -> str | None:
    """The RPC rendezvous under torchrun's agent store (None: torch's own, env://)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed.rendezvous import register_rendezvous_handler

    with contextlib.suppress(RuntimeError):  # registered already (a second run here)
        register_rendezvous_handler(_RPC_SCHEME, _attempt_rendezvous)
    return f"{_RPC_SCHEME}://"


def _leave_rpc(timeout: float) -> None:
    """Leave the RPC group once every rank is done with it (a barrier on the process group,
    while the RPC threads serve the last calls). A lost peer fails that barrier at once,
    a hung one within `timeout`: then this rank leaves alone, so that torchrun gets it
    back within --timeout to end or restart the job."""
    try:
        dist.barrier()
        together = True
    except RuntimeError:
        together = False
    quiet = logging.getLogger("torch.distributed.rpc.api")  # its traceback says the same
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        rpc.shutdown(graceful=together, timeout=timeout)
    except RuntimeError:
        pass  # a rank did not come after all: the local shutdown is done all the same
    finally:
        quiet.setLevel(level)


class _Job:
    def __init__(self, config, strategy, task, model, plan, total_steps, spe, ckpt, world):
        self.config, self.strategy, self.task, self.model = config, strategy, task, model
        self.plan, self.total_steps, self.spe, self.ckpt, self.world = (plan, total_steps, spe,
                                                                       ckpt, world)
        self.cfg = strategy.parameter_server
        self.servers, self.workers = self.cfg.servers, world.world_size - self.cfg.servers
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.owner = ps.assign_shards([p.numel() for p in self.params], self.servers)
        self.saved = ckpt["parameter_server"] if ckpt is not None else None
        self.timeout = strategy.data_parallel.timeout_s
        self.stop: Any = None
        self.warmup_note: str | None = None
        self.launch: dict[str, Any] | None = None
        """`bigbatch.train.launch_table.gather_launch`'s table (server 0 writes it)."""
        """`bigbatch.train.plan.fit_warmup`'s line, shown under the overview."""
        self.resume_from: Path | None = None
        self.stopped: Stopped | None = None
        """Set when the run ended on a signal: server 0's says where it stopped; the other
        ranks' (raised too, for the exit status) carry no step."""

    # ------------------------------------------------------------------ worker

    def alone(self) -> Any:
        """The strategy without [parameter_server]: the engine of one process."""
        return dataclasses.replace(self.strategy,
                                   parameter_server=ParameterServerConfig(enable=False))

    def work(self, sampler, slow_worker) -> dict[str, Any]:
        w = self.world.rank - self.servers
        state = (self.saved or {}).get("worker_states", {}).get(w)
        if state is not None:
            sampler.load_state_dict(state["sampler"])
            set_rng_state(state["rng"])
        else:
            data.seed_everything(self.config.seed * 1000 + w + 1)
        if self.cfg.mode == "geo":
            return geo_work(self, w, sampler, state, slow_worker)
        client = ps.Worker(w, self.params, self.owner, self.servers, self.timeout)
        barrier(self.world)  # the servers serve
        client.pull()
        autocast = self.strategy.amp.enable
        mult = 1.0 / self.plan.micro_batch_size
        steps, stop = 0, False
        while not stop:
            for micro_batches in sampler:
                loss_sum, count = torch.zeros((), dtype=torch.float64), 0.0
                for idx in micro_batches:
                    batch = data.fetch(self.task.train_set, idx, torch.device("cpu"))
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss, n = self.task.loss(self.model(batch[0]), batch)
                    # the engine's ms.backward(loss, count=n): the sum times 1 / micro
                    (loss * mult).backward()
                    loss_sum += loss.detach().double()
                    count += float(n)
                extra = {"sampler": sampler.state_dict(), "rng": rng_state(),
                         "signal": self.stop.requested if self.stop is not None else None}
                if w == 0:
                    extra["buffers"] = {k: v.detach().clone()
                                        for k, v in self.model.named_buffers()}
                grads = [p.grad for p in self.params]
                stop, _ = client.push(grads, count, float(loss_sum), extra)
                for p in self.params:
                    p.grad = None
                steps += 1
                if slow_worker is not None and slow_worker[0] == w:
                    time.sleep(slow_worker[1])
                if stop:
                    break
            if not stop:
                sampler.next_epoch()
        self.stopped_elsewhere()
        return {"worker": w, "pushes": steps}

    def stopped_elsewhere(self) -> None:
        """A rank that is not server 0: if it got a signal, it ends with that status too."""
        if self.stop is not None and self.stop.requested is not None:
            self.stopped = Stopped(self.stop.requested)

    # ------------------------------------------------------------------ server

    def _server_run(self, index: int) -> Any:
        """The engine a server steps with (geo: server 0's copy of worker 0's, whole)."""
        if self.cfg.mode != "geo":
            for p, owner in zip(self.params, self.owner, strict=True):
                p.requires_grad_(owner == index)
        plan, total, spe = self.plan, self.total_steps, self.spe
        if self.cfg.mode == "async":  # each update is one worker's batch
            plan = self.strategy.batch_plan(plan.micro_batch_size * plan.k_steps,
                                            plan.micro_batch_size, plan.k_steps, 1)
            total, spe = total * self.workers, spe * self.workers
        run = prepare(self.model, self.alone(), total_steps=total, steps_per_epoch=spe,
                      world=World(),
                      track_stats=True, plan=plan)
        if self.saved is not None:
            run.load_state_dict(self.saved["server_states"][index])
        return run

    def _step_fn(self, run: Any) -> Any:
        plan = run.plan
        weight = self.workers if self.cfg.mode == "sync" else 1
        count_mult = 1.0 / plan.micro_batch_size

        def step(grads: list[torch.Tensor], pushes: list[ps.Push]) -> None:
            total = torch.tensor(0.0, dtype=torch.float64)
            for p in pushes:
                total += p.count
            # the engine's count normalisation, as `Run.grad_factor` computes it
            factor = weight / (count_mult * total)
            if not run.avg:
                factor = factor * plan.k_steps
            torch._foreach_mul_(grads, factor)
            run.apply_gradients(grads)

        return step

    def serve(self, resume_from: Path | None) -> dict[str, Any]:
        index = self.world.rank
        self.resume_from = resume_from
        geo = self.cfg.mode == "geo"
        run = self._server_run(index) if index == 0 or not geo else None
        owned = [p for p, o in zip(self.params, self.owner, strict=True) if o == index]
        # geo: the servers add deltas (`ps.add_deltas`), with no optimizer of their own
        step_fn = (lambda grads, pushes: None) if geo else self._step_fn(run)
        server = ps.Server(index, owned, self.workers, self.cfg.mode, self.cfg.max_staleness,
                           step_fn, state_fn=run.state_dict if run is not None else lambda: None,
                           gated=index == 0)
        if self.saved is not None:
            server.version = int(self.saved["versions"][index])
            server.staleness.update({int(k): v for k, v in self.saved["staleness"][index].items()})
            server.dropped = int(self.saved["dropped"][index])
        ps.serve(server)
        barrier(self.world)  # now the workers may pull
        if index != 0:
            self.stopped_elsewhere()
            return {"server": index}
        return Driver(self, run, server).loop()

    def full_model(self, server: ps.Server, min_version: int) -> dict[str, torch.Tensor]:
        """Server 0's model with every server's tensors (and worker 0's buffers)."""
        with torch.no_grad():
            for s in range(1, self.servers):
                values, _, _ = ps.fetch(s, min_version, timeout_s=self.timeout)
                mine = [p for p, o in zip(self.params, self.owner, strict=True) if o == s]
                for p, v in zip(mine, values, strict=True):
                    p.copy_(v)
        return self.model.state_dict()

    def checkpoint_payload(self, run, server, driver) -> dict[str, Any]:
        sync = self.cfg.mode in ("sync", "geo")  # every server at the same version
        version = server.version
        states, versions, staleness, dropped = [], [], [], []
        for s in range(self.servers):
            if s == 0:
                with server.lock:
                    states.append(run.state_dict())
                    versions.append(server.version)
                    staleness.append(dict(server.staleness))
                    dropped.append(server.dropped)
            else:
                _, state, v = ps.fetch(s, version if sync else 0, with_state=True,
                                       timeout_s=self.timeout)
                states.append(state)
                versions.append(v)
                staleness.append({})
                dropped.append(0)
        with server.lock:
            model = {k: v.clone() for k, v in self.full_model(server, version if sync else 0).items()}
        # The run as a whole, in steps of one global batch (an async server updates once
        # per worker's push); each server's own state, in its updates, is server_states'.
        per = driver.per
        engine = {**states[0], "step": run.step // per, "progress": run.progress / per}
        p = self.plan
        engine["batch"] = BatchState(p.global_batch_size, p.micro_batch_size, p.k_steps,
                                     self.workers, run.unit_batch_size if sync else
                                     p.global_batch_size, configured_sizes(self.strategy)).to_dict()
        return {
            "format": CHECKPOINT_FORMAT, "step": run.step // per, "model": model,
            "engine": engine,
            "parameter_server": {
                "mode": self.cfg.mode, "servers": self.servers, "workers": self.workers,
                "server_states": states, "versions": versions, "staleness": staleness,
                "dropped": dropped, "worker_states": dict(driver.worker_states),
            },
            "samples": driver.samples, "world_size": self.world.world_size,
            "strategy": self.strategy.to_dict(), "config": self.config.to_dict(),
            "wall_time_s": driver.wall_time(),
        }
