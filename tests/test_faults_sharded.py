"""Faults in the large-network modes through the real CLI (`--nproc 2`, tiny charlm):
ZeRO-3, tensor parallelism 2 and pipeline 2, whose checkpoints are DCP shards, and the
async parameter server (3 ranks). Each ends as the single-mode faults do
(tests/test_faults.py): no traceback, one line that says what happened, the exit status
that says it, nothing lost that bigbatch did not write, and a resume that ends with the
weights of the uninterrupted run.

The default run covers every fault in one mode (ZeRO-3; the parameter server in async
mode); the `slow` ones run the same cases for tensor and pipeline parallelism, and the
rarer ends (no whole checkpoint left, --overwrite after a killed save, a lost PS worker).
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bigbatch.train.checkpoint import latest_checkpoint, list_checkpoints
from bigbatch.train.sharded import is_dcp_file, shard_problem
from tests._cli import (
    TINY,
    assert_one_line,
    assert_same_weights,
    children,
    job,
    run_cli,
    temp_files,
    tmpfs,
    worker_pid,
)

CHARLM = ["--task", "charlm", "--task-opt", "seq_len=16", "--task-opt", "d_model=32",
          "--task-opt", "n_layer=2", "--task-opt", "n_head=4",
          "--set", "batch.global_batch_size=32", "--set", "batch.base_batch_size=16",
          "--set", "batch.warmup_epochs=0", "--no-progress", "--no-tensorboard"]
MODES = {  # name: (processes, flags)
    "zero3": (2, ["--set", "sharding.stage=3"]),
    "zero3-1proc": (1, ["--set", "sharding.stage=3"]),  # DCP without a process group
    "tp2": (2, ["--set", "tensor_parallel.tensor_parallel_degree=2"]),
    "pp2": (2, ["--set", "pipeline.pp_degree=2", "--set", "pipeline.accumulate_steps=2"]),
}
SLOW = pytest.mark.slow
# ZeRO-3 in the default run; tensor and pipeline parallelism with the slow ones.
MODE_PARAMS = [pytest.param("zero3"), pytest.param("tp2", marks=SLOW),
               pytest.param("pp2", marks=SLOW)]
# The full disk and the killed save: in the default run on one process (half the time),
# on two ranks (the failure agreed over the group) with the slow ones.
DISK_PARAMS = [pytest.param("zero3-1proc"), pytest.param("zero3", marks=SLOW),
               pytest.param("tp2", marks=SLOW), pytest.param("pp2", marks=SLOW)]
STEPS = 8


def _args(mode, *more):
    nproc, flags = MODES[mode]
    return ["train", "--nproc", str(nproc), *CHARLM, *flags, "--steps", str(STEPS),
            "--checkpoint-every", "2", *more]


def _step_dir(out, step):
    return out / "checkpoints" / f"step-{step:09d}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The data cache, filled once (no run prints a data-generation line)."""
    from bigbatch.tasks import get_task

    path = tmp_path_factory.getbasetemp() / "xdg-cache"
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(path)
    try:
        get_task("charlm", seq_len=16)
        get_task("mnist1d", num_samples=1000)
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = old
    return path


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache):
    """mode -> the uninterrupted run (every checkpoint kept), made on first use."""
    made = {}

    def reference(mode):
        if mode not in made:
            out = tmp_path_factory.mktemp(f"ref-{mode}") / "run"
            p = run_cli([*_args(mode, "--keep-checkpoints", "9"), "--out", str(out)], cache)
            assert p.returncode == 0, p.stderr[-3000:]
            made[mode] = out
        return made[mode]

    return reference


def _cut_back(ref, out):
    """A copy of finished run `ref` as a crash after its last checkpoint leaves it."""
    shutil.copytree(ref, out)
    for name in ("final.pt", "summary.json"):
        (out / name).unlink()
    return out


def _shards(out, step):
    """The step's shard files, largest first."""
    return sorted((p for p in _step_dir(out, step).iterdir() if p.suffix == ".distcp"),
                  key=lambda p: -p.stat().st_size)


def _flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the tensor data: DCP itself never notices
    path.write_bytes(bytes(data))


def _record(out):
    return json.loads((out / ".bigbatch-files.json").read_text())


def _warnings(err):
    return [line for line in err.splitlines() if line.startswith("warning: checkpoint")]


# ------------------------------------------- damaged shards; a user file in a DCP folder

@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_damaged_shards_fall_back_to_the_newest_whole_checkpoint(mode, references, cache,
                                                                 tmp_path):
    """A flipped bit (step 8: only the shards' digests see it, checked by both ranks), a
    truncated shard (step 6) and a deleted one (step 4): each is named in one line, the
    resume starts from step 2 and ends with the uninterrupted run's weights. A user's
    file in step 2's folder survives the pruning of that step, with a note."""
    ref = references(mode)
    out = _cut_back(ref, tmp_path / "run")
    flipped = _shards(out, 8)[0]
    _flip_a_bit(flipped)
    truncated = _shards(out, 6)[0]
    truncated.write_bytes(truncated.read_bytes()[:1000])
    deleted = _shards(out, 4)[-1]
    deleted.unlink()
    notes = _step_dir(out, 2) / "notes.txt"
    notes.write_text("my notes on this step\n")
    p = run_cli([*_args(mode, "--keep-checkpoints", "2"), "--out", str(out), "--resume"], cache)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    warned = _warnings(p.stderr)
    rel = f"step-{8:09d}/{flipped.name}"
    assert any(f"step-000000008.pt is corrupt ({rel} checksum mismatch)" in w for w in warned), \
        p.stderr[-3000:]
    assert any("step-000000006.pt is corrupt" in w and "truncated: 1000 bytes" in w
               for w in warned), warned
    assert any("step-000000004.pt is corrupt" in w and f"{deleted.name} missing" in w
               for w in warned), warned
    assert len(warned) == 3 and all(w.endswith("using step-000000002.pt") for w in warned), \
        warned
    assert f"resuming {out} from step 2 " in p.stderr
    assert_same_weights(ref, out)
    # step 2 was pruned (keep 2): its shards went, the user's file and so its folder stay
    assert notes.read_text() == "my notes on this step\n"
    assert sorted(x.name for x in _step_dir(out, 2).iterdir()) == ["notes.txt"]
    assert not (out / "checkpoints" / "step-000000002.pt").exists()
    note = [line for line in p.stderr.splitlines() if line.startswith("note: kept")]
    assert note == ["note: kept checkpoints/step-000000002/ for notes.txt, which bigbatch "
                    "did not write"], p.stderr[-3000:]
    for step in (6, 8):  # saved again, whole
        assert shard_problem(out / "checkpoints" / f"step-{step:09d}.pt", 0, 1) is None


def test_no_whole_checkpoint_left_is_one_line_and_exit_1(references, cache, tmp_path):
    """Every checkpoint's shards truncated: the launcher finds it before any worker
    starts; nothing is written."""
    out = _cut_back(references("zero3"), tmp_path / "run")
    for step in (2, 4, 6, 8):
        shard = _shards(out, step)[0]
        shard.write_bytes(shard.read_bytes()[:-10])
    before = sorted(p.name for p in out.rglob("*"))
    p = run_cli([*_args("zero3"), "--out", str(out), "--resume"], cache)
    assert p.returncode == 1, p.stderr[-3000:]
    assert_one_line(p.stderr, f"bigbatch train: error: --resume: no good checkpoint in "
                              f"{out / 'checkpoints'}: step-000000008.pt (step-000000008/")
    assert "and 1 more" in p.stderr  # four named: three shown
    assert sorted(p.name for p in out.rglob("*")) == before


@pytest.mark.slow
def test_no_checkpoint_whose_shards_every_rank_verified_is_one_line_and_exit_1(
        references, cache, tmp_path):
    """Bit flips only the workers' digests see: they agree on it and end with one line."""
    out = _cut_back(references("zero3"), tmp_path / "run")
    for step in (2, 4, 6, 8):
        _flip_a_bit(_shards(out, step)[-1])  # rank 1's share or rank 0's: both look
    p = run_cli([*_args("zero3"), "--out", str(out), "--resume"], cache)
    assert p.returncode == 1, p.stderr[-3000:]
    assert_one_line(p.stderr, "bigbatch train: error: --resume: no good checkpoint in ")
    assert "checksum mismatch" in p.stderr.splitlines()[-1]
    assert not (out / "final.pt").exists()


# -------------------------------- a full disk, then a save killed mid-way, then resume

def _kill_mid_save(out, proc, workers, timeout=180):
    """Freeze every worker (SIGSTOP) once a sharded save has written a file into its
    temporary folder, then SIGKILL the job: what a crash in the middle of a save leaves.
    Returns the temporary folder and the workers' pids. (A save that finishes between
    the look and the stop is let go: the next one is caught.)"""
    ckpts = out / "checkpoints"
    deadline = time.monotonic() + timeout
    pids: list[int] = []
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ended first ({proc.returncode}): {proc.stderr.read()}"
        if len(pids) < workers:
            pids = children(proc.pid) if workers > 1 else [proc.pid]
            continue
        for tmp in ckpts.glob(".step-*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                if not any(is_dcp_file(p.name) for p in tmp.iterdir()):
                    continue
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                if any(is_dcp_file(p.name) for p in tmp.iterdir()):
                    os.killpg(proc.pid, signal.SIGKILL)
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    proc.wait(30)
                    _wait_gone(pids)
                    return tmp
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        time.sleep(0.0005)
    raise AssertionError("no sharded save caught in time")


def _wait_gone(pids, timeout=30):
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _checkpoint_bytes(out, step):
    """What one checkpoint takes on a tmpfs (its files' pages)."""
    files = [*_step_dir(out, step).iterdir(), out / "checkpoints" / f"step-{step:09d}.pt",
             out / "checkpoints" / f"step-{step:09d}.json"]
    return sum(-(-f.stat().st_size // 4096) * 4096 for f in files)


@pytest.mark.parametrize("mode", DISK_PARAMS)
def test_full_disk_then_a_killed_save_then_resume_is_exact(mode, references, cache, tmp_path):
    """On a real tmpfs with room for about two and a half checkpoints: the third sharded
    save fails (on one rank or both); one line says what, where and how much space is
    left, exit 1, the partial temporary folder is gone and the two checkpoints before it
    are whole. With room again, `--resume` is killed in the middle of a sharded save:
    its temporary folder is left, recorded as bigbatch's. The next `--resume` removes
    it and ends with the uninterrupted run's weights."""
    ref = references(mode)
    size_k = (_checkpoint_bytes(ref, 8) * 5 // 2 + 256 * 1024) // 1024
    with tmpfs(tmp_path / "disk", f"size={size_k}k") as disk:
        out = disk / "run"
        args = [*_args(mode, "--keep-checkpoints", "2"), "--out", str(out)]
        p = run_cli(args, cache)
        assert p.returncode == 1, p.stderr[-3000:]
        last = p.stderr.strip().splitlines()[-1]
        assert_one_line(p.stderr, "No space left on device")
        assert last.startswith("bigbatch train: error: saving checkpoint step-000000006"), last
        assert f"free in {out / 'checkpoints'}" in last and last.endswith(
            "; kept step-000000004.pt"), last
        assert not list((out / "checkpoints").glob(".step-*.tmp")) and temp_files(out) == []
        assert [c.name for c in list_checkpoints(out)] == ["step-000000002.pt",
                                                           "step-000000004.pt"]
        for c in list_checkpoints(out):
            assert shard_problem(c, 0, 1) is None
        assert _record(out)["temp_dirs"] == []

        subprocess.run(["mount", "-o", "remount,size=40m", str(disk)], check=True)
        with job([*args, "--resume", "--checkpoint-every", "1"], cache) as proc:
            tmp = _kill_mid_save(out, proc, MODES[mode][0])
        assert tmp.is_dir() and any(is_dcp_file(x.name) for x in tmp.iterdir())
        assert f"checkpoints/{tmp.name}" in _record(out)["temp_dirs"]  # recorded first
        assert latest_checkpoint(out) is not None

        p = run_cli([*args, "--resume"], cache)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "Traceback" not in p.stderr and not _warnings(p.stderr)
        assert not tmp.exists() and _record(out)["temp_dirs"] == []
        assert_same_weights(ref, out)


@pytest.mark.slow
def test_overwrite_after_a_killed_save_is_not_refused_for_its_temporary_folder(
        references, cache, tmp_path):
    out = tmp_path / "run"
    args = [*_args("zero3", "--checkpoint-every", "1"), "--out", str(out)]
    with job(args, cache) as proc:
        tmp = _kill_mid_save(out, proc, 2)
    assert f"checkpoints/{tmp.name}" in _record(out)["temp_dirs"]
    p = run_cli([*_args("zero3"), "--out", str(out), "--overwrite"], cache)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not tmp.exists() and _record(out)["temp_dirs"] == []
    assert_same_weights(references("zero3"), out)


# ---------------------------------------------------------- async parameter server

PS_ASYNC = ["train", "--nproc", "3", "--set", "parameter_server.servers=1",
            "--set", "parameter_server.mode=async", *TINY, "--checkpoint-every", "5"]


def _metrics(out, kind):
    return [x for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if x["kind"] == kind]


@pytest.mark.slow  # ~40 s: three processes, a signal and a resume
def test_async_parameter_server_counts_global_batches_and_resumes_after_sigterm(
        cache, tmp_path):
    """A step is one global batch (both workers' gradients applied) in --steps, the
    checkpoints, the metrics and the summary; SIGTERM stops at a step boundary, and
    --resume continues to --steps."""
    from bigbatch.train.checkpoint import load_checkpoint

    out, steps = tmp_path / "ps", 60
    args = [*PS_ASYNC, "--steps", str(steps), "--out", str(out)]
    with job(args, cache) as proc:
        deadline = time.monotonic() + 180
        while not list((out / "checkpoints").glob("step-*.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert_one_line(err, "bigbatch train: stopped by SIGTERM after step ")
    step = int(err.strip().splitlines()[-1].split("after step ")[1].split(";")[0])
    assert 5 <= step < steps, err[-3000:]
    ckpt = load_checkpoint(out / "checkpoints" / f"step-{step:09d}.pt")
    assert ckpt["step"] == step and ckpt["engine"]["progress"] == step
    assert ckpt["parameter_server"]["versions"] == [2 * step]  # 2 updates a step
    assert max(x["step"] for x in _metrics(out, "train")) == step

    p = run_cli([*args, "--resume"], cache)  # the README's own resume
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming {out} from step {step} (async parameter server" in p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["samples"] == steps * 64
    hist = summary["parameter_server"]["staleness_histogram"]
    assert sum(hist.values()) == 2 * steps  # each step: both workers' gradients
    train = _metrics(out, "train")
    assert train[-1]["step"] == steps and all(x["step"] <= steps for x in train)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_lost_parameter_server_worker_ends_or_restarts_within_the_timeout(
        mode, restarts, cache, tmp_path):
    """A worker SIGKILLed after the first checkpoint: without restarts the job ends in one
    line, exit 1, within --timeout (and process start-up); with --max-restarts 1 the
    group restarts from the last checkpoint and finishes."""
    # (not shorter: on a loaded 2-core box three workers start up to ~10 s apart)
    out, timeout = tmp_path / "ps", 30
    args = ["train", "--nproc", "3", "--set", "parameter_server.servers=1",
            "--set", f"parameter_server.mode={mode}", *TINY, "--checkpoint-every", "5",
            "--steps", "120", "--timeout", str(timeout), "--max-restarts", str(restarts),
            "--out", str(out)]
    with job(args, cache) as proc:
        deadline = time.monotonic() + 180
        victim = None
        while victim is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            if list((out / "checkpoints").glob("step-*.json")):
                victim = worker_pid(proc.pid, 2)
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=180)
        seconds = time.monotonic() - t0
    assert "Traceback" not in err, err[-3000:]
    if restarts:
        assert proc.returncode == 0, err[-3000:]
        assert "resuming" in err
        assert json.loads((out / "summary.json").read_text())["steps"] == 120
    else:
        assert proc.returncode == 1, err[-3000:]
        assert_one_line(err, "bigbatch train: error: worker rank 2 was killed by SIGKILL; "
                             "continue from the last checkpoint with --resume")
        assert seconds < timeout + 10, seconds
