"""Reliability of `bigbatch train`: non-finite losses (`nan_policy`), a killed worker, hangs."""

import contextlib
import importlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bigbatch.cli.main import main
from bigbatch.config.strategy import Strategy
from bigbatch.train.checkpoint import latest_checkpoint, load_checkpoint
from bigbatch.train.nonfinite import NonFiniteLossError
from bigbatch.train.trainer import TrainConfig, train
from tests._cli import worker_pid

T = importlib.import_module("bigbatch.train.plan")  # where the main job builds its task

SMALL = {"num_samples": 1000}  # 800 train samples: 12 steps of 64 per epoch
STRATEGY = """
[batch]
global_batch_size = 64
base_batch_size = 64
base_lr = 0.05
warmup_steps = 0
decay = "none"

[optimizer]
type = "momentum"
"""


pytestmark = pytest.mark.usefixtures("train_env")


def _config(out, **kw):
    base = dict(task="mnist1d", model="mlp", task_options=SMALL, steps=8, out=str(out),
                checkpoint_every=2, log_every=1, progress=False, tensorboard=False)
    return TrainConfig(**{**base, **kw})


def _nan_at(monkeypatch, steps):
    """Make the task's loss NaN at these optimizer steps (1-based; one micro-step per step)."""
    real = T.get_task
    calls = []

    def get_task(*args, **kw):
        task = real(*args, **kw)
        loss = task.loss

        def nan_loss(out, batch):
            calls.append(1)
            total, count = loss(out, batch)
            return (total * math.nan if len(calls) in steps else total), count

        task.loss = nan_loss
        return task

    monkeypatch.setattr(T, "get_task", get_task)


def _finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_nan_policy_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path,
                                                                           monkeypatch):
    out = tmp_path / "run"
    _nan_at(monkeypatch, {3})
    with pytest.raises(NonFiniteLossError, match="non-finite loss at optimizer step 3 "):
        train(_config(out), Strategy.from_toml(STRATEGY))
    assert not (out / "final.pt").exists() and not (out / "summary.json").exists()
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and load_checkpoint(ckpt)["step"] == 2
    assert _finite(load_checkpoint(ckpt)["model"])


def test_nan_policy_skip_skips_and_counts_then_stops_when_it_persists(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _nan_at(monkeypatch, {3, 4})
    summary = train(_config(out, nan_policy="skip"), Strategy.from_toml(STRATEGY))
    assert summary["steps"] == 8 and summary["nonfinite_skipped_steps"] == 2
    assert summary["samples"] == 10 * 64  # the skipped steps' batches were drawn
    assert json.loads((out / "summary.json").read_text())["nonfinite_skipped_steps"] == 2
    assert _finite(torch.load(out / "final.pt", weights_only=True))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if x["kind"] == "train"]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)

    _nan_at(monkeypatch, set(range(3, 100)))
    with pytest.raises(NonFiniteLossError, match="at 10 consecutive optimizer steps, the last "
                                                  "at step 3 "):
        train(_config(out, nan_policy="skip", steps=20, overwrite=True),
              Strategy.from_toml(STRATEGY))
    assert not (out / "final.pt").exists()
    assert _finite(load_checkpoint(latest_checkpoint(out))["model"])


def test_cli_nan_policy_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    _nan_at(monkeypatch, {2})
    cfg = tmp_path / "s.toml"
    cfg.write_text(STRATEGY)
    code = main(["train", "--nproc", "1", "--config", str(cfg), "--out", str(tmp_path / "o"),
                 "--task-opt", "num_samples=1000", "--model", "mlp", "--steps", "4",
                 "--no-progress", "--no-tensorboard", "--nan-policy", "stop"])
    err = capsys.readouterr().err
    assert code == 1
    last = err.splitlines()[-1]
    assert last.startswith("bigbatch train: error: non-finite loss at optimizer step 2 "), err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert main(["train", "--nan-policy", "never"]) == 2
    with pytest.raises(Exception, match="nan_policy='never' is not valid; allowed: stop, skip"):
        TrainConfig(nan_policy="never")


def _skip_on_rank1(config, strategy_text):
    import torch.distributed as dist

    mp = pytest.MonkeyPatch()
    if dist.get_rank() == 1:  # only one worker sees it: all must skip together
        _nan_at(mp, {3})
    try:
        return train(config, Strategy.from_toml(strategy_text))["nonfinite_skipped_steps"]
    finally:
        mp.undo()


def test_two_workers_skip_together(tmp_path):
    from bigbatch.tasks import get_task
    from tests._dist import run_workers

    get_task("mnist1d", **SMALL)  # fill the cache before the workers start
    out = tmp_path / "run"
    got = run_workers(_skip_on_rank1, 2, (_config(out, nan_policy="skip", steps=4), STRATEGY),
                      timeout=120, init_group=True)
    assert got == [1, 1]
    assert _finite(torch.load(out / "final.pt", weights_only=True))


# ------------------------------------------------------------ lost worker, hangs (torchrun)

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ["--task-opt", "num_samples=1000", "--set", "batch.global_batch_size=64",
          "--set", "batch.base_batch_size=32", "--set", "batch.warmup_epochs=0",
          "--no-progress", "--no-tensorboard", "--nproc", "2"]


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                        "TORCHELASTIC_RESTART_COUNT")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1", **extra)
    return env


def _hang_on_rank1(argv, cache):
    import contextlib
    import io

    import torch.distributed as dist

    os.environ["XDG_CACHE_HOME"] = cache
    mp = pytest.MonkeyPatch()
    rank = int(os.environ["RANK"])
    real = T.get_task

    def get_task(*args, **kw):  # rank 1 hangs in its second forward
        task = real(*args, **kw)
        loss, calls = task.loss, []

        def slow_loss(out, batch):
            calls.append(1)
            if rank == 1 and len(calls) == 2:
                time.sleep(8)
            return loss(out, batch)

        task.loss = slow_loss
        return task

    mp.setattr(T, "get_task", get_task)
    err = io.StringIO()
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        mp.undo()
        if dist.is_initialized():
            dist.destroy_process_group()
    return code, err.getvalue(), time.monotonic() - t0


@pytest.mark.slow  # waits out a hung peer (~17 s)
def test_hung_peer_ends_the_run_with_one_line(tmp_path):
    from bigbatch.tasks import get_task
    from tests._dist import run_workers

    cache = os.environ["XDG_CACHE_HOME"]
    get_task("mnist1d", **SMALL)  # fill the cache before the workers start
    cfg = tmp_path / "s.toml"
    cfg.write_text(STRATEGY)
    argv = ["train", "--config", str(cfg), "--out", str(tmp_path / "o"), "--task-opt",
            "num_samples=1000", "--model", "mlp", "--steps", "6", "--no-progress",
            "--no-tensorboard", "--timeout", "3"]
    got = run_workers(_hang_on_rank1, 2, (argv, cache), timeout=120)
    code, err, seconds = got[0]  # rank 0 waited for rank 1
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    # No torchrun agent store to hold a roll call in: the line cannot name the rank.
    assert last.startswith("bigbatch train: error: a peer did not answer within "
                           "data_parallel.timeout_s=3s"), err
    assert last.endswith("(dead or hung worker)"), err
    assert "Traceback" not in err and seconds < 60
    assert got[1][0] == 1  # and rank 1 does not wait forever either


# A stopped worker (SIGSTOP) is hung for real: alive, its sockets open, answering nothing.
# Its peer's collective times out after --timeout s; torchrun then stops the group with
# SIGTERM, which a stopped process does not act on, and SIGKILL 30 s later.
# The launcher prints one line for the job, naming the rank that did not answer.
# Where rank 0 waited (all_reduce, backward, barrier) depends on where rank 1 stopped.
HUNG_LINE = (f"bigbatch train: error: worker rank 1 (host {socket.gethostname()}) did not "
             "answer within data_parallel.timeout_s=3s")


def _hung_lines(output):
    return [line for line in output.splitlines() if "did not answer" in line]
STOP_ARGS = [*LAUNCH, "--steps", "40", "--checkpoint-every", "2", "--timeout", "3"]


def _our_worker(pid, out):
    """True while `pid` is still a worker of the run writing to `out` (pids get reused)."""
    try:
        return str(out).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _train_and_signal_rank1(tmp_path, out, sig, *args):
    """Run `bigbatch train *args`, send rank 1 `sig` (SIGKILL: a dead worker, SIGSTOP: a hung
    one) after a checkpoint, return (exit code, output, seconds from the signal to the end of
    the job). Whatever happens, nothing is left behind: the launcher's and every worker's
    process group (torchrun starts each worker in its own session) get SIGCONT and SIGKILL."""
    cmd = [sys.executable, "-m", "bigbatch", "train", *args, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    workers = set()
    try:
        deadline = time.monotonic() + 120
        victim, at = None, random.randrange(2, 20, 2)  # signal after step `at`'s checkpoint
        print(f"{sig.name} to rank 1 after step {at}'s checkpoint")
        while time.monotonic() < deadline and proc.poll() is None:
            ckpts = [int(p.stem[5:]) for p in (out / "checkpoints").glob("step-*.pt")]
            victim = worker_pid(proc.pid, rank=1) if max(ckpts, default=0) >= at else None
            if victim is not None:
                break
            time.sleep(0.1)
        assert victim is not None, f"no worker to signal (launcher exit code {proc.poll()})"
        workers |= {victim, worker_pid(proc.pid, rank=0)} - {None}
        os.kill(victim, sig)
        sent = time.monotonic()
        assert not (out / "final.pt").exists(), "finished before the signal"
        output, _ = proc.communicate(timeout=150)
        return proc.returncode, output, time.monotonic() - sent
    finally:
        if proc.poll() is None:  # the workers of now, then the launcher (no more restarts)
            workers |= {worker_pid(proc.pid, rank=r) for r in (0, 1)} - {None}
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for pid in workers:
            if _our_worker(pid, out):
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, sig)


def _uninterrupted_run(tmp_path, *args):
    out = tmp_path / "full"
    p = subprocess.run([sys.executable, "-m", "bigbatch", "train", *args, "--out", str(out)],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _assert_same_final_weights(full, cut, steps):
    a = torch.load(full / "final.pt", weights_only=True)
    b = torch.load(cut / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((cut / "summary.json").read_text())["steps"] == steps


@pytest.mark.slow
def test_killed_worker_is_restarted_and_ends_with_the_same_weights(tmp_path):
    args = [*LAUNCH, "--steps", "40", "--checkpoint-every", "2"]
    full = _uninterrupted_run(tmp_path, *args)
    code, output, _ = _train_and_signal_rank1(tmp_path, tmp_path / "cut", signal.SIGKILL,
                                              *args, "--max-restarts", "1")
    assert code == 0, output[-3000:]
    assert "resuming" in output, output[-3000:]
    _assert_same_final_weights(full, tmp_path / "cut", 40)


def _raised(output):
    """The exception line that ends each Python traceback in `output`."""
    ends, inside = [], False
    for line in output.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            inside = True
        elif inside and line and not line[0].isspace():
            ends.append(line.rstrip())
            inside = False
    return ends


@pytest.mark.slow
def test_stopped_worker_under_torchrun_ends_the_run_with_one_line(tmp_path):
    code, output, seconds = _train_and_signal_rank1(tmp_path, tmp_path / "run", signal.SIGSTOP,
                                                    *STOP_ARGS)
    print(f"exit {code} {seconds:.1f} s after the stop; output:\n{output}")
    assert code != 0, output[-3000:]
    hung = _hung_lines(output)  # one line for the job, the launcher's
    assert len(hung) == 1 and hung[0].startswith(HUNG_LINE), output[-3000:]
    assert hung[0].endswith("(hung or stopped); continue from the last checkpoint with "
                            "--resume, or give a slow worker more time with --timeout")
    assert "[W" not in output and "c10d" not in output, output[-3000:]  # no C++ warnings
    assert _raised(output) == [], output[-3000:]  # no traceback, torchrun's report included
    # 3 s timeout + 2 s roll call + torchrun's 30 s SIGTERM grace (+ a loaded machine)
    assert seconds < 3 + 35 + 15, output[-3000:]


@pytest.mark.slow
def test_stopped_worker_under_torchrun_is_restarted_and_ends_with_the_same_weights(tmp_path):
    full, cut = _uninterrupted_run(tmp_path, *STOP_ARGS), tmp_path / "cut"
    code, output, seconds = _train_and_signal_rank1(tmp_path, cut, signal.SIGSTOP, *STOP_ARGS,
                                                    "--max-restarts", "1")
    print(f"exit {code} {seconds:.1f} s after the stop; output:\n{output}")
    assert code == 0, output[-3000:]
    hung = _hung_lines(output)  # the first attempt's end, said by rank 0 before the restart
    assert len(hung) == 1 and hung[0].startswith(HUNG_LINE), output[-3000:]
    assert _raised(output) == [], output[-3000:]
    assert "resuming" in output, output[-3000:]
    _assert_same_final_weights(full, cut, 40)


def test_timeout_flag_sets_the_collective_and_rendezvous_timeouts(tmp_path):
    from bigbatch.cli.main import build_parser
    from bigbatch.cli.train import _torchrun_argv, resolve

    argv = ["train", "--out", str(tmp_path), "--nproc", "2", "--timeout", "42.5"]
    args = build_parser("train").parse_args(argv)
    timeout = resolve(args)[1].data_parallel.timeout_s
    assert timeout == 42.5
    cmd = _torchrun_argv(args, argv[1:], timeout)
    assert cmd[cmd.index("--rdzv-conf") + 1] == "join_timeout=42,read_timeout=42"
    assert cmd[cmd.index("bigbatch") + 1:].count("--timeout") == 1  # workers get it too
    assert main(["train", "--timeout", "0"]) == 2


def test_skip_under_gradient_merge_drops_the_whole_step(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _nan_at(monkeypatch, {3})  # the first micro-step of optimizer step 2 (k_steps = 2)
    merged = STRATEGY + "\n[gradient_merge]\nk_steps = 2\n"
    summary = train(_config(out, nan_policy="skip", steps=4), Strategy.from_toml(merged))
    assert summary["k_steps"] == 2 and summary["steps"] == 4
    assert summary["nonfinite_skipped_steps"] == 1
    assert _finite(torch.load(out / "final.pt", weights_only=True))
