"""Paddle's half-async parameter-server mode has no bigbatch mode of its own: the settings
that Fleet's `half_async` refusal names (the async mode, a merge of CPU_NUM micro-batches
summed, no stale gradient dropped) train to a literal transcription of Paddle's
HalfAsyncCommunicator and non-sync dense table.

In Paddle (paddle/fluid/distributed/ps/service/communicator/communicator.cc) each of a
trainer's CPU_NUM threads queues its gradient (`AsyncCommunicator::Send`) and waits in
`send_barrier` (`HalfAsyncCommunicator::Barrier`); the communicator's thread, once all
CPU_NUM are in (`BatchesCounter`), sums them (`MergeVars`, merge_add), pushes the sum
(`RpcSendDense`), pulls the parameters (`RecvByCommunicator`) and releases the threads
(`BarrierWeakUp`); no barrier joins the trainers (`BarrierSend`/`BarrierRecv` are empty
outside `SyncCommunicator`), and the server's dense table, not being sync, applies each
push as it arrives (`CommonDenseTable::push_dense` -> `_push_dense`, the SGD rule).

The test runs one worker: with several, which push lands first is timing, in Paddle as
here, and no run could be compared with a reference. With one the order is determined.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from _dist import run_workers

from bigbatch.config.fleet import translate
from bigbatch.errors import ConfigError

THREADS, PER_THREAD, LR, STEPS = 2, 16, 0.05, 8
"""CPU_NUM threads of one trainer, each thread's batch, Paddle's SGD learning rate."""

FLEET = f"""
batch_size = {PER_THREAD}
a_sync = true

[optimizer]
type = "SGD"
learning_rate = {LR}
"""


def settings() -> list[str]:
    """The `--set` pairs of the `half_async` refusal, for CPU_NUM = THREADS."""
    with pytest.raises(ConfigError) as e:
        translate("half_async = true\n" + FLEET)
    pairs = re.findall(r"--set (\S+)", str(e.value))
    assert pairs and "a_sync = true" in str(e.value)
    return [p.replace("CPU_NUM", str(THREADS)) for p in pairs]


def test_the_refusal_names_settings_that_build():
    strategy = translate(FLEET).build().with_overrides(settings())
    ps, merge = strategy.parameter_server, strategy.gradient_merge
    assert (ps.mode, merge.k_steps, merge.avg) == ("async", THREADS, False)
    assert ps.max_staleness >= 10**6
    assert strategy.resolve(1).global_batch_size == THREADS * PER_THREAD


def _config(out, cache):
    from bigbatch.train.trainer import TrainConfig

    os.environ["XDG_CACHE_HOME"] = cache
    return TrainConfig(task="mnist1d", model="mlp", task_options={"num_samples": 1000},
                       steps=STEPS, out=out, checkpoint_every=100, log_every=4,
                       progress=False, tensorboard=False)


def _job(out, cache, overrides):
    from bigbatch.train.trainer import train

    torch.set_num_threads(1)
    return train(_config(out, cache), translate(FLEET).build().with_overrides(overrides))


def _paddle_half_async(out, cache, overrides):
    """One trainer of THREADS threads and one server, as Paddle runs them: each step every
    thread computes the gradient of its batch's mean loss at the parameters last pulled,
    the communicator sums them, the server applies p -= lr * sum at once, the trainer
    pulls. The batches are the ones the bigbatch worker drew (its sampler, rebuilt)."""
    from bigbatch.parallel.world import World
    from bigbatch.train import data
    from bigbatch.train.plan import build_model, load_task, plan_run

    config = _config(out, cache)
    strategy = translate(FLEET).build().with_overrides(overrides)
    task = load_task(config, World())
    _, sampler, _, _ = plan_run(config, strategy, task, 2, rank=1)  # the worker of 2 ranks
    model = build_model(task, task.check_model(config.model), config.seed, strategy)
    server = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = {n: v.clone() for n, v in server.items()}
    batches = iter(sampler)
    for _ in range(STEPS):
        threads = next(batches)
        assert len(threads) == THREADS
        with torch.no_grad():  # RecvByCommunicator: the trainer takes the server's values
            for n, p in model.named_parameters():
                p.copy_(server[n])
        queued = []
        for idx in threads:  # each thread: its batch's mean loss, backward; Send queues it
            batch = data.fetch(task.train_set, idx, torch.device("cpu"))
            loss, n = task.loss(model(batch[0]), batch)
            queued.append(torch.autograd.grad(loss / n, list(model.parameters())))
        merged = [sum(gs[1:], gs[0].clone()) for gs in zip(*queued, strict=True)]  # MergeVars
        with torch.no_grad():  # push_dense -> _push_dense: the SGD rule, on arrival
            for (name, _), g in zip(model.named_parameters(), merged, strict=True):
                server[name] -= LR * g
    return server, start


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "xdg-cache")


@pytest.mark.slow  # ~10 s: one 2-rank job (RPC start-up dominates)
def test_one_trainer_trains_as_paddles_half_async(tmp_path, cache):
    overrides = settings()
    out = str(tmp_path / "ps")
    summary, _ = run_workers(_job, 2, args=(out, cache, overrides), timeout=300)
    assert summary["steps"] == STEPS and summary["parameter_server"]["mode"] == "async"
    got = torch.load(os.path.join(out, "final.pt"), weights_only=True)
    want, start = _paddle_half_async(str(tmp_path / "reference"), cache, overrides)
    worst = max(float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items())
    assert worst < 1e-5, worst
    assert all(not torch.allclose(want[n], start[n]) for n in want)  # it trained
