"""A worker of the parameter server's geo mode (Fleet's GEO-SGD; `bigbatch.train.ps_job`
runs it, `bigbatch.parallel.parameter_server` has the exchange): the engine steps this
worker's own copy, and every `geo_k_steps` steps the delta goes to the servers."""

from __future__ import annotations

import time
from typing import Any

import torch

from bigbatch.engine import prepare
from bigbatch.engine.saving import rng_state
from bigbatch.parallel import parameter_server as ps
from bigbatch.parallel.world import World, barrier
from bigbatch.train import data

__all__ = ["geo_work"]


def geo_work(job: Any, w: int, sampler: Any, state: dict[str, Any] | None,
             slow_worker: tuple[int, float] | None) -> dict[str, Any]:
    """Worker `w`'s loop: k local optimizer steps on its batches, then the delta exchanged,
    until server 0 says stop. `state`: this worker's part of the checkpoint (its engine
    state and the progress it kept), None for a new run; the sampler and RNG are loaded."""
    # The global plan on one process, as the sync server runs it: the LR and schedule
    # of the global batch, each worker's gradient the mean over its own items.
    run = prepare(job.model, job.alone(), total_steps=job.total_steps,
                  steps_per_epoch=job.spe, world=World(), plan=job.plan)
    if state is not None:
        run.load_state_dict(state["engine"])
    client = ps.Worker(w, job.params, job.owner, job.servers, job.timeout)
    barrier(job.world)  # the servers serve
    client.pull()
    if state is not None:
        client.keep(state["kept"])
    k = job.cfg.geo_k_steps
    loss_sum, count = torch.zeros((), dtype=torch.float64), 0.0
    rounds, stop = 0, False
    while not stop:
        for micro_batches in sampler:
            for idx in micro_batches:
                batch = data.fetch(job.task.train_set, idx, torch.device("cpu"))
                with run.micro_step() as ms:
                    loss, n = job.task.loss(run.model(batch[0]), batch)
                    ms.backward(loss, count=n)
                loss_sum += loss.detach().double()
                count += float(n)
            if run.step % k and not run.done:
                continue  # the round goes on
            extra = {"sampler": sampler.state_dict(), "rng": rng_state(),
                     "signal": job.stop.requested if job.stop is not None else None,
                     "geo_engine": run.state_dict()}
            if w == 0:
                extra["buffers"] = {n: v.detach().clone()
                                    for n, v in job.model.named_buffers()}
            stop, _ = client.push_delta(job.workers, count, float(loss_sum), extra)
            loss_sum, count = torch.zeros((), dtype=torch.float64), 0.0
            rounds += 1
            if slow_worker is not None and slow_worker[0] == w:
                time.sleep(slow_worker[1])
            if stop:
                break
        if not stop:
            sampler.next_epoch()
    job.stopped_elsewhere()
    return {"worker": w, "pushes": rounds, "steps": run.step}

