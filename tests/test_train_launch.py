"""`bigbatch train --nproc 2` through torchrun's launcher, as a user runs it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--task-opt", "num_samples=1000", "--set", "batch.global_batch_size=64",
         "--set", "batch.base_batch_size=32", "--set", "batch.warmup_epochs=0",
         "--no-progress", "--no-tensorboard"]


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _bigbatch(args, tmp_path, timeout=180):
    return subprocess.run([sys.executable, "-m", "bigbatch", "train", *args], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)


def test_nproc_2_through_torchrun(tmp_path):
    out = tmp_path / "run"
    p = _bigbatch(["--nproc", "2", "--out", str(out), "--steps", "4", *SMALL], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert (s["world_size"], s["steps"], s["micro_batch_size"]) == (2, 4, 32)
    assert p.stdout.count("test accuracy") == 1 and "test accuracy" not in p.stderr  # rank 0


def test_nproc_error_before_workers_start(tmp_path):
    p = _bigbatch(["--nproc", "2", "--out", str(tmp_path / "o"), "--task-opt",
                   "num_samples=1000", "--set", "batch.global_batch_size=100000"], tmp_path)
    assert p.returncode == 2
    # The data-generation notice may come first; the error is one line, and the last.
    last = p.stderr.strip().splitlines()[-1]
    assert "larger than the training set" in last and "Traceback" not in p.stderr


@pytest.mark.slow
def test_killed_torchrun_job_resumes_to_the_same_weights(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = ["--nproc", "2", "--steps", "60", "--checkpoint-every", "3", *SMALL]
    p = _bigbatch([*args, "--out", str(full)], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    proc = subprocess.Popen([sys.executable, "-m", "bigbatch", "train", *args, "--out", str(cut)],
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((cut / "checkpoints").glob("step-*.pt")) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job: launcher and both workers
    proc.wait(30)
    assert not (cut / "final.pt").exists(), "finished before it could be killed"
    p = _bigbatch(["--nproc", "2", "--out", str(cut), "--resume", "--no-progress"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming" in p.stderr
    a = torch.load(full / "final.pt", weights_only=True)
    b = torch.load(cut / "final.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k
