"""Resume with changed settings: what `bigbatch.train.resume` allows continues exactly;
anything else, and a checkpoint this version cannot resume from, is refused with one
line and the run directory exactly as it was.

Runs `bigbatch.cli.main.main` in this process (the CLI's code path without a
launcher); the stop before a resume is a real SIGTERM to this process.
"""

import json
import os
import re
import shutil
import signal
import threading
import time

import pytest
import torch

from bigbatch.cli.main import main
from bigbatch.train.checkpoint import CHECKPOINT_FORMAT, latest_checkpoint, manifest_path
from tests._cli import TINY, assert_same_weights, in_process, snapshot

RUN = ["train", "--nproc", "1", *TINY, "--steps", "36", "--checkpoint-every", "5"]

pytestmark = pytest.mark.usefixtures("train_env")


def _sigterm_at_first_checkpoint(out):
    """A thread that sends this process SIGTERM once `out` has a checkpoint."""
    def watch():
        deadline = time.monotonic() + 60
        while not list((out / "checkpoints").glob("step-*.json")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run, and the same run stopped by SIGTERM after its first checkpoint."""
    root = tmp_path_factory.mktemp("resume_changes")
    with in_process(tmp_path_factory.getbasetemp() / "xdg-cache"):
        assert main([*RUN, "--out", str(root / "full")]) == 0
        watcher = _sigterm_at_first_checkpoint(root / "cut")
        assert main([*RUN, "--out", str(root / "cut")]) == 143
        watcher.join(5)
    assert not (root / "cut" / "final.pt").exists()
    return root


def _copy(runs, tmp_path, name="cut"):
    out = tmp_path / name
    shutil.copytree(runs / name, out)
    return out


S = "--set"
ALLOWED = [
    ("cadence", ["--checkpoint-every", "7", "--log-every", "3", "--eval-every", "4",
                 "--keep-checkpoints", "3"]),
    ("timeout", ["--timeout", "45"]),
    ("timeout_key", [S, "data_parallel.timeout_s=45"]),
    ("elastic", [S, "batch.elastic=scale"]),
    ("nan_policy", ["--nan-policy", "skip"]),
    ("same_length_given_again", ["--steps", "36"]),
]


@pytest.mark.parametrize("argv", [c[1] for c in ALLOWED], ids=[c[0] for c in ALLOWED])
def test_allowed_changes_resume_to_the_uninterrupted_weights(argv, runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    assert main([*RUN, "--out", str(out), "--resume", *argv]) == 0, capsys.readouterr().err
    assert_same_weights(runs / "full", out)
    if "45" in argv[-1]:  # the new timeout is what strategy.toml now records
        assert "timeout_s = 45.0" in (out / "strategy.toml").read_text()


def test_a_longer_run_is_allowed_and_counts_on(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    capsys.readouterr()
    assert main([*RUN, "--out", str(out), "--resume", "--steps", "40"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 40
    # The decay is re-stretched over the new length, and the resume says so in one line
    # with the LR of the first step after the checkpoint, before and after.
    printed = capsys.readouterr()
    lines = [x for x in (printed.out + printed.err).splitlines()
             if x.startswith("the schedule now decays over 40 steps (was 36): the LR jumps from")]
    assert len(lines) == 1, printed
    step = int(re.search(r"resuming .* from step (\d+)", printed.out + printed.err)[1])
    assert lines[0].endswith(f" at step {step + 1}")
    before, after = (float(w) for w in lines[0].split("jumps from ")[1].split(" at ")[0]
                     .split(" to "))
    assert after > before > 0  # cosine: later in a longer decay is a higher LR


def test_the_same_length_prints_no_schedule_line(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    capsys.readouterr()
    assert main([*RUN, "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr()
    assert "the schedule now decays" not in printed.out + printed.err


REFUSED = [
    ("lr", [S, "batch.base_lr=0.2"], "batch.base_lr 0.1 -> 0.2"),
    ("lars_coeff", [S, "lars.lars_coeff=0.02"], "lars.lars_coeff 0.01 -> 0.02"),
    ("weight_decay", [S, "lars.lars_weight_decay=0.0"], "lars.lars_weight_decay 0.0005 -> 0.0"),
    ("lars_to_lamb", [S, "lars.enable=false", S, "lamb.enable=true", S, "optimizer.type=adamw"],
     "optimizer.type 'momentum' -> 'adamw', lars.enable True -> False"),
    ("micro_batch", [S, "batch.micro_batch_size=32"], "batch.micro_batch_size None -> 32"),
    ("gradient_merge", [S, "gradient_merge.k_steps=2"], "gradient_merge.enable False -> True"),
    ("amp", [S, "amp.dtype=bfloat16"], "amp.enable False -> True"),
    ("stateful_reduce", [S, "lars.enable=false", S, "data_parallel.reduce=dgc"],
     "data_parallel.reduce 'mean' -> 'dgc'"),  # DGC's hook owns momentum: train/resume.py
    ("decay", [S, "batch.decay=none"], "batch.decay 'cosine' -> 'none'"),
    ("many", [S, "batch.base_lr=0.2", S, "batch.decay=none", S, "optimizer.momentum=0.5",
              S, "lars.lars_coeff=0.02", S, "lars.epsilon=0.1"], "and 1 more"),
    ("seed", ["--seed", "1"], "seed 0 -> 1"),
    ("data", ["--task-opt", "num_samples=1200"], "task_options"),
    ("model", ["--model", "cnn"], "model 'mlp' -> 'cnn'"),
    ("shorter", ["--steps", "2"], "--steps 2 ends before checkpoint"),
    ("epochs_shorter", ["--epochs", "0.1"], "--epochs 0.1 (1 steps) ends before checkpoint"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_other_changes_are_refused_with_one_line_and_nothing_written(argv, message, runs,
                                                                     capsys):
    out = runs / "cut"
    before = snapshot(out)
    capsys.readouterr()
    base = RUN[:RUN.index("--steps")] + RUN[RUN.index("--steps") + 2:] if "--epochs" in argv else RUN
    code = main([*base, "--out", str(out), "--resume", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err
    assert snapshot(out) == before


# ------------------------------------------------------- checkpoints it cannot resume from

def _replace_payload(out, payload):
    """The latest checkpoint's payload replaced by `payload` (bytes, or an object to
    torch.save), with a manifest that verifies: only the format check can refuse it."""
    import hashlib

    path = latest_checkpoint(out)
    if isinstance(payload, bytes):
        path.write_bytes(payload)
    else:
        torch.save(payload, path)
    data = path.read_bytes()
    manifest = json.loads(manifest_path(path).read_text())
    manifest.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path(path).write_text(json.dumps(manifest))
    return path


def _with(ckpt, **changes):
    out = dict(ckpt)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


PAYLOADS = [
    ("newer_format", lambda c: _with(c, format=CHECKPOINT_FORMAT + 1),
     f"has format {CHECKPOINT_FORMAT + 1}, from a newer bigbatch"),
    ("no_format", lambda c: _with(c, format=None), "has format None, from a bigbatch before 0.1.0"),
    ("format_not_int", lambda c: _with(c, format="1"), "has format '1'"),
    ("a_state_dict", lambda c: c["model"], "is not a bigbatch training checkpoint"),
    ("a_list", lambda c: [1, 2, 3], "is not a bigbatch training checkpoint (a list)"),
    ("incomplete", lambda c: _with(c, sampler=None), "is incomplete: no sampler"),
    ("not_a_pickle", lambda c: b"this is not a checkpoint", "cannot be read: "),
    ("foreign_strategy", lambda c: _with(c, strategy={"sharding_v9": {}}),
     "the checkpoint's strategy is not one this version reads"),
]


@pytest.mark.parametrize("make, message", [c[1:] for c in PAYLOADS], ids=[c[0] for c in PAYLOADS])
def test_checkpoint_it_cannot_resume_from_is_one_line(make, message, runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    ckpt = torch.load(latest_checkpoint(out), weights_only=False)
    _replace_payload(out, make(ckpt))
    before = snapshot(out)
    capsys.readouterr()
    code = main([*RUN, "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert snapshot(out) == before
