"""A failure a user meets ends in one line that says what to change: out of memory names
the micro batch, a parameter one rank does not use names the parameter (and
`data_parallel.find_unused_parameters` lets it train), more workers than GPUs under NCCL
is refused before anything starts, and the launcher prints one line for the job however
many ranks failed. (Hung and stopped ranks: tests/test_reliability.py.)"""

import contextlib
import importlib
import io
import json
import os
import types

import pytest
import torch

from bigbatch.cli.failure_report import ERROR, PEER, PEER_NAMED, choose
from bigbatch.cli.main import main
from tests._cli import TINY, run_cli

T = importlib.import_module("bigbatch.train.plan")  # where the main job builds its task

ARGS = ["train", *TINY, "--steps", "3", "--nproc", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from bigbatch.tasks.mnist1d import load_data

    path = tmp_path_factory.getbasetemp() / "xdg-cache"
    load_data(1000, 42, path / "bigbatch")
    return path


def _main(argv, cache):
    err = io.StringIO()
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old
    return code, err.getvalue()


def _failing_loss(monkeypatch, exc):
    real = T.get_task

    def get_task(*args, **kw):
        task = real(*args, **kw)

        def loss(out, batch):
            raise exc

        task.loss = loss
        return task

    monkeypatch.setattr(T, "get_task", get_task)


OOMS = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                     "allocate memory: you tried to allocate 85899345920 bytes. Error code 12")]


@pytest.mark.parametrize("exc", OOMS, ids=["cuda", "cpu"])
def test_out_of_memory_is_one_line_naming_the_micro_batch(exc, cache, tmp_path, monkeypatch):
    _failing_loss(monkeypatch, exc)
    code, err = _main([*ARGS, "--out", str(tmp_path / "run")], cache)
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    where = "GPU" if isinstance(exc, torch.OutOfMemoryError) else "CPU"
    assert last.startswith(f"bigbatch train: error: out of {where} memory at micro batch "
                           "size 64 per worker (global batch 64 = 64 x k_steps 1 x 1 "
                           "workers): --set batch.micro_batch_size=32 --set "
                           "gradient_merge.k_steps=2 keeps the global batch 64"), err
    assert "recompute.enable=true" in last and "sharding.stage=2" in last
    assert "Traceback" not in err and sum("memory" in line for line in err.splitlines()) == 1


def test_more_workers_than_gpus_under_nccl_is_refused_before_anything(cache, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "run"
    code, err = _main(["train", *TINY, "--steps", "3", "--nproc", "2", "--out", str(out)], cache)
    assert code == 2, err
    assert err == ("bigbatch train: error: --nproc 2 starts 2 workers on 1 GPU(s), and NCCL "
                   "(data_parallel.backend=auto) needs one GPU per worker: use --nproc 1 "
                   "(--nproc auto), or --set data_parallel.backend=gloo to let workers share "
                   "GPUs (slower)\n")
    assert not out.exists()


def test_find_unused_parameters_under_fsdp2_needs_a_torch_with_its_pass(cache, tmp_path,
                                                                        monkeypatch):
    """On a torch without FSDPModule.set_reduce_scatter_unused_params (2.11; mocked by
    removing it) stage 2-3 with find_unused_parameters is refused before any worker
    starts: exit code 2, one line naming the key and the torch it needs."""
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params", raising=False)
    out = tmp_path / "run"
    code, err = _main([*ARGS[:-2], "--nproc", "2", "--out", str(out), "--set",
                       "data_parallel.find_unused_parameters=true", "--set", "sharding.stage=2"],
                      cache)
    assert code == 2, err
    version = torch.__version__.split("+")[0]
    assert err == ("bigbatch train: error: data_parallel.find_unused_parameters = true with "
                   f"sharding.stage = 2 needs torch 2.13 or newer (this is torch {version}): "
                   "FSDP2 reduces a zero gradient for a parameter a rank did not use only "
                   "from torch 2.13 on (FSDPModule.set_reduce_scatter_unused_params); upgrade "
                   "torch, use every parameter in forward on every rank, or sharding.stage = "
                   "1 (DDP's pass)\n"), err
    assert not out.exists()


# ----------------------------------------------------------- a branch one rank skips

def _train_with_a_branch_rank1_skips(argv, cache):
    """`bigbatch train` in a worker whose model has `branch`, used on rank 0 only."""
    import torch.distributed as dist
    from torch import nn

    os.environ["XDG_CACHE_HOME"] = cache
    rank = int(os.environ["RANK"])
    mp = pytest.MonkeyPatch()
    real = T.get_task

    def get_task(*args, **kw):
        task = real(*args, **kw)
        build = task.build_model

        def build_model(*a, **k):
            model = build(*a, **k)
            model.branch = nn.Linear(2, 1)
            inner = model.forward

            def forward(x):
                out = inner(x)
                return out + 0 * model.branch.weight.sum() if rank == 0 else out

            model.forward = forward
            return model

        task.build_model = types.MethodType(lambda self, *a, **k: build_model(*a, **k), task)
        return task

    mp.setattr(T, "get_task", get_task)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        mp.undo()
        if dist.is_initialized():
            dist.destroy_process_group()
    return code, err.getvalue()


@pytest.mark.parametrize("find_unused", [False, True], ids=["refused", "find_unused"])
def test_a_parameter_one_rank_does_not_use(find_unused, cache, tmp_path):
    from tests._dist import run_workers

    argv = [*ARGS[:-2], "--out", str(tmp_path / "run"), "--timeout", "20"]
    if find_unused:
        argv += ["--set", "data_parallel.find_unused_parameters=true"]
    got = run_workers(_train_with_a_branch_rank1_skips, 2, (argv, str(cache)), timeout=120)
    if find_unused:
        assert [code for code, _ in got] == [0, 0], got
        return
    code, err = got[1]
    assert code == 1, err
    assert err.strip().splitlines()[-1] == (
        "bigbatch train: error: parameter(s) branch.weight, branch.bias got no gradient on "
        "rank 1 in a step (a part of the model that worker did not use): --set "
        "data_parallel.find_unused_parameters=true lets DDP expect it, or use every "
        "parameter in forward"), err
    assert "Traceback" not in err
    assert got[0][0] != 0


# ------------------------------------------------------------- one line per job

def _failure(exitcode, line=None, kind=ERROR, at=100.0, status=1):
    message = "" if line is None else json.dumps(
        {"bigbatch_failure": {"line": line, "status": status, "kind": kind, "time": at}})
    return types.SimpleNamespace(exitcode=exitcode, message=message, timestamp=int(at))


def test_the_launcher_picks_one_line_for_the_job():
    named = "rank 2 did not answer"
    # A stopped rank: the others name it; torchrun SIGKILLs it 30 s later.
    assert choose({0: _failure(1, named, PEER_NAMED, 100.5), 1: _failure(1, "?", PEER, 100.7),
                   2: _failure(-9, at=131)}) == (named, 1, None)
    # A non-finite loss every rank saw, or an OOM on one and peers losing it: the cause.
    assert choose({0: _failure(1, "peer", PEER, 99.0), 1: _failure(1, "oom", ERROR, 101.0)}
                  ) == ("oom", 1, None)
    assert choose({0: _failure(2, "bad key", ERROR, status=2)}) == ("bad key", 2, None)
    # A worker killed outright before anyone failed: the launcher names it itself.
    assert choose({1: _failure(-9, at=100), 0: _failure(1, named, PEER_NAMED, 102.9)}
                  ) == (None, 1, 1)
    # One killed outright, the survivor ended by torchrun's SIGTERM in the same second:
    # the killed one is named, whatever the ranks' order.
    assert choose({0: _failure(-15, at=100), 1: _failure(-9, at=100)}) == (None, 1, 1)
    assert choose({0: _failure(-9, at=100), 1: _failure(-15, at=100)}) == (None, 1, 0)
    # A worker that printed its own traceback: its status, nothing more.
    assert choose({0: _failure(3, at=100)}) == (None, 3, None)


@pytest.mark.slow  # ~8 s: a 2-worker job through torchrun
def test_a_non_finite_loss_on_two_ranks_is_one_line(cache, tmp_path):
    p = run_cli(["train", *TINY, "--nproc", "2", "--steps", "20", "--out", str(tmp_path / "run"),
                 "--set", "batch.base_lr=1e30"], cache)
    assert p.returncode == 1, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if "non-finite loss" in line]
    assert len(lines) == 1 and lines[0] == p.stderr.strip().splitlines()[-1], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "[W" not in p.stderr


@pytest.mark.slow  # ~45 s: waits out the join timeout and torchrun's 30 s SIGTERM grace
def test_a_rank_that_never_joins_is_named_without_cpp_warnings(cache, tmp_path):
    import signal
    import time

    from tests._cli import job, worker_pid

    out = tmp_path / "run"
    args = ["train", *TINY, "--nproc", "2", "--steps", "40", "--timeout", "3", "--out", str(out)]
    with job(args, cache) as proc:
        deadline, victim = time.monotonic() + 60, None
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            victim = worker_pid(proc.pid, rank=1)  # stopped before it can join the group
            time.sleep(0.005)
        assert victim is not None, proc.stderr.read()
        os.kill(victim, signal.SIGSTOP)
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if "did not answer" in line]
    assert lines == [err.strip().splitlines()[-1]], err[-3000:]
    assert lines[0].startswith("bigbatch train: error: worker rank 1 did not answer within "
                               "data_parallel.timeout_s=3s in init_process_group"), err[-3000:]
    assert "[W" not in err and "c10d" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("sig, says", [
    (9, "worker rank 1 was killed by SIGKILL; continue from the last checkpoint with --resume"),
    (6, "worker rank 1 aborted in torch (SIGABRT; the line above says why): a collective that "
        "differs between ranks, e.g. a parameter one rank does not use under sharding.stage "
        "2-3, or NCCL's watchdog after data_parallel.timeout_s")], ids=["SIGKILL", "SIGABRT"])
def test_a_worker_killed_by_a_signal_is_named_by_the_launcher(sig, says, monkeypatch, capsys):
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from bigbatch.cli.launch import run_torchrun

    def run(args):
        raise ChildFailedError("bigbatch", {1: ProcessFailure(1, 4242, -sig, "/nonexistent")})

    monkeypatch.setattr(torchrun, "run", run)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_CPP_LOG_LEVEL",
                 "BIGBATCH_LAUNCHER_PID"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    code = run_torchrun(["--standalone", "--nproc-per-node", "2", "-m", "bigbatch"],
                        command="train", timeout=5)
    assert code == 1
    assert capsys.readouterr().err == f"bigbatch train: error: {says}\n"
