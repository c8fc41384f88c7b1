"""The parameter server: its protocol in-process (the sync mean is DDP's arithmetic, async
never applies a gradient beyond max_staleness), and the main job on real ranks (slow):
sync equals DDP bit for bit and resumes exactly, two servers too, async keeps its bound
with a slowed worker, and the CLI launches it and refuses a resume on other ranks."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from _dist import run_workers

from bigbatch.config.strategy import Strategy
from bigbatch.errors import ConfigError
from bigbatch.parallel.parameter_server import Push, Server, assign_shards, mean_gradient
from bigbatch.train.ps_job import check_resume

# ---------------------------------------------------------------- protocol, in-process


def _server(mode, workers=2, max_staleness=2):
    applied = []
    param = torch.zeros(3)

    def step(grads, pushes):
        applied.append([(p.worker, p.version) for p in pushes])
        param.sub_(grads[0])

    return Server(0, [param], workers, mode, max_staleness, step), applied, param


def test_sync_steps_once_every_worker_is_in_on_ddps_mean():
    server, applied, param = _server("sync")
    g0, g1 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, -1.0, 1e-8])
    f0 = server.push(Push(0, 0, [g0], 4, 1.0))
    assert not f0.done() and applied == []  # waits for worker 1
    f1 = server.push(Push(1, 0, [g1], 4, 1.0))
    r0, r1 = f0.wait(), f1.wait()
    assert applied == [[(0, 0), (1, 0)]] and r0.version == r1.version == 1
    # DDP divides each worker's bucket by W, then sums: the same bits
    assert torch.equal(param, -(g0 / 2 + g1 / 2))
    assert torch.equal(r0.params[0], param) and r0.params[0] is not param  # a copy goes out
    assert torch.equal(mean_gradient([Push(0, 0, [g0], 1, 0), Push(1, 0, [g1], 1, 0)])[0],
                       g0 / 2 + g1 / 2)


def test_async_never_applies_a_gradient_beyond_max_staleness():
    server, applied, _ = _server("async", max_staleness=2)
    replies = [server.push(Push(0, server.version, [torch.ones(3)], 1, 0.0)).wait()
               for _ in range(5)]
    assert [r.version for r in replies] == [1, 2, 3, 4, 5]
    late = server.push(Push(1, 2, [torch.ones(3)], 1, 0.0)).wait()  # 5 - 2 = 3 > 2
    ok = server.push(Push(1, 3, [torch.ones(3)], 1, 0.0)).wait()  # 5 - 3 = 2
    assert not late.applied and ok.applied and late.version == 5 and ok.version == 6
    assert server.dropped == 1 and dict(server.staleness) == {0: 5, 2: 1}
    assert (1, 2) not in [p for step in applied for p in step]


def test_async_bound_holds_under_racing_workers():
    server, applied, _ = _server("async", workers=4, max_staleness=1)
    rng = random.Random(0)
    delays = {w: rng.uniform(0, 0.004) * (w + 1) for w in range(4)}

    def worker(w):
        version = 0
        for _ in range(30):
            time.sleep(delays[w])
            version = server.push(Push(w, version, [torch.ones(3)], 1, 0.0)).wait().version

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(server.staleness) <= 1 and sum(server.staleness.values()) == server.version
    assert server.version + server.dropped == 120 and server.dropped > 0


def test_finished_server_applies_nothing_more():
    server, applied, _ = _server("async")
    server.push(Push(0, 0, [torch.ones(3)], 1, 0.0)).wait()
    server.finish()
    r = server.push(Push(0, 1, [torch.ones(3)], 1, 0.0)).wait()
    assert r.stop and not r.applied and len(applied) == 1


def test_shards_are_whole_tensors_balanced_by_size():
    assert assign_shards([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # loads 110 and 110
    assert assign_shards([5, 5, 5], 1) == [0, 0, 0]
    assert sorted(set(assign_shards([3, 2, 1], 3))) == [0, 1, 2]


def test_resume_needs_the_same_servers_and_workers():
    on = Strategy().with_overrides(["parameter_server.servers=1"])
    ckpt = {"parameter_server": {"servers": 1, "workers": 2}}
    check_resume(ckpt, on, 3, "step-5.pt")
    with pytest.raises(ConfigError, match="has 1 server\\(s\\) and 2 worker\\(s\\)"):
        check_resume(ckpt, on, 4, "step-5.pt")
    with pytest.raises(ConfigError, match="written in parameter-server mode"):
        check_resume(ckpt, Strategy(), 2, "step-5.pt")
    with pytest.raises(ConfigError, match="written without parameter-server mode"):
        check_resume({}, on, 3, "step-5.pt")


# ---------------------------------------------------------------- the main job, real ranks

# The main job's small LARS run of tests/test_train.py: 800 train samples, 12 steps of 64 an epoch.
from test_train import SMALL, STRATEGY  # noqa: E402


def _job(out, overrides, cache, resume_from_step=None, slow=None):
    """In each rank: train (optionally after cutting `out` back to a checkpoint)."""
    from bigbatch.parallel.world import World
    from bigbatch.train.ps_job import train_parameter_server
    from bigbatch.train.trainer import TrainConfig, train

    os.environ["XDG_CACHE_HOME"] = cache
    torch.set_num_threads(1)
    strategy = Strategy.from_toml(STRATEGY).with_overrides(overrides)
    config = TrainConfig(task="mnist1d", model="cnn", task_options=SMALL, steps=18, out=out,
                         checkpoint_every=5, log_every=2, progress=False, tensorboard=False,
                         keep_checkpoints=9, resume=resume_from_step is not None)
    if slow is not None:
        return train_parameter_server(config, strategy, World.from_env(), slow_worker=slow)
    return train(config, strategy)


def _final(out):
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def _lines(out, kind):
    text = (Path(out) / "metrics.jsonl").read_text()
    return [x for x in map(json.loads, text.splitlines()) if x["kind"] == kind]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cut_back(out, cut, step):
    """A copy of run `out` as a crash after checkpoint `step` would leave it."""
    shutil.copytree(out, cut)
    for name in os.listdir(os.path.join(cut, "checkpoints")):
        if int(name.split("-")[1].split(".")[0]) > step:
            os.remove(os.path.join(cut, "checkpoints", name))
    for name in ("final.pt", "summary.json"):
        os.remove(os.path.join(cut, name))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "xdg-cache")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, cache):
    out = str(tmp_path_factory.mktemp("ddp") / "run")
    run_workers(_job, 2, args=(out, [], cache), timeout=300)
    return out


@pytest.mark.slow  # ~60 s on 2 shared cores: a 2-rank and a 3-rank job, then a resume
def test_sync_equals_ddp_and_resumes_exactly(ddp, tmp_path, cache):
    out, cut = str(tmp_path / "ps"), str(tmp_path / "cut")
    (summary, *_rest) = run_workers(_job, 3, args=(out, ["parameter_server.servers=1"], cache),
                                    timeout=300)
    assert summary["parameter_server"]["workers"] == 2 and summary["steps"] == 18
    assert _same(_final(out), _final(ddp))  # weights and BatchNorm buffers, bit for bit
    evals, ddp_evals = _lines(out, "eval"), _lines(ddp, "eval")
    assert [(e["step"], e["accuracy"]) for e in evals] == [(e["step"], e["accuracy"])
                                                           for e in ddp_evals]
    assert len(evals) >= 2
    _cut_back(out, cut, 5)
    run_workers(_job, 3, args=(cut, ["parameter_server.servers=1"], cache, 5), timeout=300)
    assert _same(_final(cut), _final(out))


@pytest.mark.slow  # ~40 s: 4 ranks
def test_two_servers_equal_ddp(ddp, tmp_path, cache):
    out = str(tmp_path / "ps2")
    run_workers(_job, 4, args=(out, ["parameter_server.servers=2"], cache), timeout=300)
    assert _same(_final(out), _final(ddp))


@pytest.mark.slow  # ~30 s
def test_async_keeps_the_staleness_bound_with_a_slow_worker(tmp_path, cache):
    out = str(tmp_path / "async")
    overrides = ["parameter_server.mode=async", "parameter_server.max_staleness=1"]
    summary, *_ = run_workers(_job, 3, args=(out, overrides, cache, None, (1, 0.05)),
                              timeout=300)
    info = summary["parameter_server"]
    assert max(info["staleness_histogram"]) <= 1 and info["dropped"] > 0
    # a step is one global batch: 2 workers' gradients applied
    assert summary["steps"] == 18 and sum(info["staleness_histogram"].values()) == 36
    train = _lines(out, "train")
    assert all(x["staleness_max"] <= 1 for x in train) and train[-1]["dropped"] == info["dropped"]


@pytest.mark.slow  # ~60 s: torchrun starts 3 processes, twice
def test_cli_runs_one_server_and_two_workers(tmp_path, cache, capsys, monkeypatch):
    from bigbatch.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    out = tmp_path / "cli"
    base = ["train", "--nproc", "3", "--set", "parameter_server.servers=1", "--no-progress",
            "--no-tensorboard", "--task-opt", "num_samples=1000", "--steps", "6",
            "--set", "batch.global_batch_size=64", "--set", "batch.base_batch_size=32",
            "--set", "batch.warmup_epochs=0", "--out", str(out)]
    assert main(base) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["parameter_server"]["workers"] == 2 and s["micro_batch_size"] == 32
    capsys.readouterr()
    assert main(["train", "--resume", "--nproc", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 1 server(s) and 2 worker(s)" in err, err


@pytest.mark.slow  # ~60 s: three 3-process jobs
def test_sigterm_checkpoints_where_it_stops_and_resume_is_exact(tmp_path):
    """The launcher's SIGTERM reaches server 0 and the workers: server 0 checkpoints after
    the step in progress, every rank ends with 143, and the sync run resumes exactly."""
    import signal

    from tests._cli import (
        TINY,
        assert_one_line,
        assert_same_weights,
        run_cli,
        start_cli,
        wait_for_checkpoint,
    )

    cache = tmp_path / "xdg-cache"
    args = ["train", "--nproc", "3", "--set", "parameter_server.servers=1", *TINY,
            "--steps", "200", "--checkpoint-every", "10"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    p = run_cli([*args, "--out", str(full)], cache)
    assert p.returncode == 0, p.stderr[-3000:]
    proc = start_cli([*args, "--out", str(cut)], cache)
    try:
        wait_for_checkpoint(cut, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert_one_line(err, "bigbatch train: stopped by SIGTERM after step ")
    step = int(err.strip().splitlines()[-1].split("after step ")[1].split(";")[0])
    assert 10 <= step < 200 and (cut / "checkpoints" / f"step-{step:09d}.json").is_file()
    assert not (cut / "final.pt").exists()
    p = run_cli([*args, "--out", str(cut), "--resume"], cache)
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = [line for line in p.stderr.splitlines() if line.startswith("resuming")]
    assert resumed and resumed[0].startswith(f"resuming {cut} from step {step} "), resumed
    assert_same_weights(full, cut)


def test_rpc_starts_without_torchs_deprecation_warning(monkeypatch):
    """torch's TensorPipe set-up calls an object collective on a Backend (deprecated since
    torch 2.0); `start_rpc` keeps that torch-internal warning from every rank's output."""
    import socket
    import warnings

    from torch.distributed import rpc

    from bigbatch.parallel.parameter_server import start_rpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            assert start_rpc(0, 1, 1, 30.0) == "ps0"
        finally:
            rpc.shutdown()
    assert not [w for w in seen if "deprecated" in str(w.message)], [str(w.message) for w in seen]


@pytest.mark.slow  # ~90 s: torchrun starts 3 processes, twice
def test_async_steps_are_global_batches_and_resume_extends_them(tmp_path, cache, capfd,
                                                                monkeypatch):
    """`--steps 4` in async mode ends at step 4 (one step = one global batch applied: a
    push from each of the 2 workers), and `--resume --steps 6` continues it to step 6."""
    from bigbatch.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    out = tmp_path / "async"
    base = ["train", "--nproc", "3", "--set", "parameter_server.servers=1", "--set",
            "parameter_server.mode=async", "--no-progress", "--no-tensorboard", "--task-opt",
            "num_samples=1000", "--model", "mlp", "--set", "batch.global_batch_size=64",
            "--set", "batch.base_batch_size=32", "--set", "batch.warmup_epochs=0", "--out",
            str(out)]
    assert main([*base, "--steps", "4"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert max(r["step"] for r in _lines(out, "train")) == 4
    assert main([*base, "--resume", "--steps", "6"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    err = capfd.readouterr().err
    assert "resuming" in err and "deprecated" not in err
