"""The output directory: bigbatch deletes only files it wrote itself, never a folder
because of its name; a fresh run does not replace a run without `--overwrite`; one
job at a time holds a directory, and a dead job's lock blocks nothing.

Runs `bigbatch.cli.main.main` in this process, except the lock holder, which is
another process (a lock is per process)."""

import json
import shutil
import socket
from pathlib import Path

import pytest

from bigbatch.cli.main import main
from tests._cli import TINY, assert_error_line, snapshot, temp_files, tmpfs

RUN = ["train", "--nproc", "1", *TINY, "--steps", "4", "--checkpoint-every", "2"]
DATA = Path(__file__).parent / "data" / "run_v0_1"

pytestmark = pytest.mark.usefixtures("train_env")


def _run(capsys, *argv):
    capsys.readouterr()
    code = main([*RUN, *argv])
    return code, capsys.readouterr().err


@pytest.fixture
def project(tmp_path):
    """A project with its own `checkpoints/` and `tensorboard/` folders and files."""
    root = tmp_path / "project"
    for rel, text in (("checkpoints/model.pt", "mine"), ("tensorboard/events.out.tfevents.1.h",
                                                         "mine"), ("train.py", "print()\n")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("again", [[], ["--overwrite"]], ids=["fresh", "overwrite"])
def test_out_dot_in_a_project_leaves_its_own_folders_alone(project, again, capsys,
                                                           monkeypatch):
    monkeypatch.chdir(project)
    before = snapshot(project)
    code, err = _run(capsys, "--out", ".", *again)
    assert code == 2
    assert_error_line(err, "checkpoints/ holds checkpoints/model.pt, which bigbatch did not write")
    assert snapshot(project) == before


def test_a_file_of_the_same_name_is_never_replaced(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("my own metrics\n")
    before = snapshot(out)
    code, err = _run(capsys, "--out", str(out), "--overwrite")
    assert code == 2
    assert_error_line(err, "metrics.jsonl exists and bigbatch did not write it")
    assert snapshot(out) == before


def test_a_fresh_run_into_a_run_is_refused_and_overwrite_deletes_only_its_files(tmp_path,
                                                                                  capsys):
    out = tmp_path / "run"
    assert _run(capsys, "--out", str(out))[0] == 0
    (out / "notes.txt").write_text("mine\n")
    (out / "plots").mkdir()
    (out / "plots" / "loss.png").write_bytes(b"png")
    before = snapshot(out)
    code, err = _run(capsys, "--out", str(out))
    assert code == 2
    assert_error_line(err, f"--out {out} holds a run (finished); continue it with --resume, "
                           "or replace it with --overwrite")
    assert snapshot(out) == before
    old = set(json.loads((out / ".bigbatch-files.json").read_text())["files"])
    assert {"final.pt", "summary.json", "metrics.jsonl", "checkpoints/step-000000004.pt"} <= old
    assert _run(capsys, "--out", str(out), "--overwrite", "--seed", "1")[0] == 0
    assert (out / "notes.txt").read_text() == "mine\n" and (out / "plots" / "loss.png").exists()
    assert json.loads((out / "summary.json").read_text())["seed"] == 1


def test_a_0_1_run_is_recognised_by_its_files(tmp_path, capsys):
    out = tmp_path / "old"
    shutil.copytree(DATA, out)  # a 0.1.0 run: no record of its files
    before = snapshot(out)
    code, err = _run(capsys, "--out", str(out))
    assert code == 2 and "holds a run (latest checkpoint step-000000002.pt)" in err, err
    assert snapshot(out) == before
    assert _run(capsys, "--out", str(out), "--overwrite")[0] == 0
    assert (out / "expected_final.pt").exists()  # not a name bigbatch writes: kept
    assert sorted(p.name for p in (out / "checkpoints").glob("*.pt")) == [
        "step-000000002.pt", "step-000000004.pt"]  # the new run's


def test_temporary_files_of_an_interrupted_save_go_at_the_next_start(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(capsys, "--out", str(out))[0] == 0
    # What a job killed (SIGKILL) in the middle of saving step 6 leaves behind: the step
    # recorded (save_checkpoint records a file before writing it) and its temporary file.
    record = json.loads((out / ".bigbatch-files.json").read_text())
    record["files"].append("checkpoints/step-000000006.pt")
    (out / ".bigbatch-files.json").write_text(json.dumps(record))
    left = [out / "checkpoints" / ".step-000000006.pt.4242.tmp", out / ".summary.json.4242.tmp"]
    for p in left:
        p.write_bytes(b"partial")
    (out / "checkpoints" / ".step-000000099.pt.4242.tmp").write_bytes(b"never recorded")
    (out / ".draft.4242.tmp").write_text("not bigbatch's")
    code, err = _run(capsys, "--out", str(out), "--resume", "--steps", "6")
    assert code == 0, err
    assert sorted(temp_files(out)) == [out / ".draft.4242.tmp",
                                       out / "checkpoints" / ".step-000000099.pt.4242.tmp"]


def _holder(out: str, held) -> None:
    import time

    from bigbatch.train.lock import OutLock

    OutLock(out).acquire()
    held.set()
    time.sleep(600)


def _hold_lock(out):
    """Another process holding `out`'s lock (as a running job does); stop it with .kill().
    A fork of tests/_dist.py's fork server, which has bigbatch imported already (a fresh
    interpreter would spend ~4 s importing torch)."""
    from tests._dist import _context

    ctx = _context()
    held = ctx.Event()
    proc = ctx.Process(target=_holder, args=(str(out), held), daemon=True)
    proc.start()
    assert held.wait(60), "the lock holder did not take the lock"
    return proc


@pytest.mark.parametrize("again", [[], ["--resume", "--steps", "6"], ["--overwrite"]],
                         ids=["fresh", "resume", "overwrite"])
def test_a_directory_another_job_holds_is_refused_naming_it(again, tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(capsys, "--out", str(out))[0] == 0
    holder = _hold_lock(out)
    try:
        before = snapshot(out)
        code, err = _run(capsys, "--out", str(out), *again)
        assert code == 2
        assert_error_line(err, f"is in use by another bigbatch job (pid {holder.pid} on "
                               f"{socket.gethostname()}); wait for it to end")
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.join(30)
    assert not holder.is_alive()
    # The holder is dead: its lock file still names it, and blocks nothing.
    assert str(holder.pid) in (out / ".bigbatch.lock").read_text()
    code, err = _run(capsys, "--out", str(out), *again)
    assert "in use" not in err
    assert (code, "holds a run" in err) == ((2, True) if again == [] else (0, False)), err


def test_a_refused_job_leaves_no_trace_where_there_was_nothing(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    code, err = _run(capsys, "--out", str(out), "--set", "batch.global_batch_size=100000")
    assert code == 2 and "larger than the training set" in err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("where", ["out", "cache"])
def test_read_only_out_or_data_cache(where, tmp_path, capsys, monkeypatch):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        if where == "out":
            code, err = _run(capsys, "--out", str(ro / "run"))
            expected = f"--out {ro / 'run'}: {ro} is not writable (read-only file system)"
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", str(ro))
            code, err = _run(capsys, "--out", str(tmp_path / "run"), "--task-opt",
                             "num_samples=1100")  # not cached yet: it would be generated
            expected = f"cannot create the data cache directory {ro / 'bigbatch'}: Read-only"
        assert code == 2
        assert_error_line(err, expected)
        assert not (tmp_path / "run").exists()
