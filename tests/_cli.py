"""Running the real `bigbatch` command in a subprocess, and what a test checks of its end:
the exit status, one line on stderr, no traceback, and the output directory.

    p = run_cli(["train", *TINY, "--out", str(out)], tmp_path)
    proc = start_cli(["train", ...], tmp_path)      # a Popen, for signals
    before = snapshot(out); ...; assert snapshot(out) == before
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# 1000 samples (800 train): 12 steps of 64 an epoch; the MLP takes a few ms a step.
TINY = ["--task-opt", "num_samples=1000", "--model", "mlp", "--set", "batch.global_batch_size=64",
        "--set", "batch.base_batch_size=32", "--set", "batch.warmup_epochs=0", "--no-progress",
        "--no-tensorboard"]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "BIGBATCH_OUT_LOCKED", "BIGBATCH_LAUNCHER_PID")


def cli_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def run_cli(args: list[str], cache: Path, timeout: float = 180, cwd: Path = ROOT,
            **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bigbatch", *args], cwd=cwd,
                          env=cli_env(cache, **extra), capture_output=True, text=True,
                          timeout=timeout)


def start_cli(args: list[str], cache: Path, **extra: str) -> subprocess.Popen:
    """`bigbatch ARGS` in its own session (so a test can end all of it), stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "bigbatch", *args], cwd=ROOT,
                            env=cli_env(cache, **extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_checkpoint(out: Path, proc: subprocess.Popen, timeout: float = 120) -> Path:
    """The first checkpoint `proc` writes in `out` (fails if it ends or times out first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted((out / "checkpoints").glob("step-*.json"))  # the manifest: committed
        if found:
            return found[0].with_suffix(".pt")
        assert proc.poll() is None, f"ended early ({proc.returncode}): {proc.stderr.read()}"
        time.sleep(0.02)
    raise AssertionError("no checkpoint in time")


def assert_one_line(err: str, expected: str) -> None:
    """stderr ends in one line containing `expected`, which no other line mentions, and
    holds no traceback."""
    lines = err.strip().splitlines()
    assert lines and expected in lines[-1], err[-3000:]
    assert sum(expected in line for line in lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def assert_error_line(err: str, expected: str) -> None:
    """stderr is exactly one line, `bigbatch ...: error: ...expected...` (no traceback)."""
    assert err.count("\n") == 1 and err.endswith("\n"), err[-3000:]
    assert "error:" in err and expected in err, err
    assert "Traceback" not in err


def snapshot(path: Path) -> dict | None:
    """Every entry under `path`: name -> (mtime, sha256), or None when it is missing."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {".": (os.stat(path).st_mtime_ns, hashlib.sha256(f.read()).hexdigest())}
    snap = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            digest = None
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            snap[os.path.relpath(p, path)] = (os.stat(p).st_mtime_ns, digest)
    return snap


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def temp_files(out: Path) -> list[Path]:
    """Temporary files of atomic writes (`.NAME.PID.tmp`) anywhere under `out`."""
    return [p for p in out.rglob(".*.tmp")]


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@contextlib.contextmanager
def job(args: list[str], cache: Path) -> Iterator[subprocess.Popen]:
    """`bigbatch ARGS` running; whatever happens, its session is killed at the end."""
    proc = start_cli(args, cache)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of worker `rank` under `bigbatch train` (torchrun's agent runs in it), or None."""
    for pid in children(launcher_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def running(pid: int) -> bool:
    """True while `pid` exists and has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@contextlib.contextmanager
def in_process(cache: Path) -> Iterator[None]:
    """`bigbatch.cli.main.main` in this process as a module fixture runs it: the shared data
    cache and one intra-op thread (both restored after)."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted at `path` (`options`, e.g. "size=1400k" or "ro,size=1m");
    skips the test where that is impossible (not root, or no mount allowed)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (chmod does not stop root)")
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
