"""Atomic checkpoints, RNG capture, and the resumable distributed batch sampler."""

import random

import numpy as np
import pytest
import torch

from bigbatch.engine.saving import rng_state, set_rng_state
from bigbatch.errors import ConfigError
from bigbatch.tasks.sampler import GlobalBatchSampler
from bigbatch.train.checkpoint import (
    atomic_save,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def test_atomic_save_replaces_whole_file_or_nothing(tmp_path):
    path = tmp_path / "sub" / "x.pt"
    atomic_save({"a": torch.arange(3)}, path)
    assert torch.equal(torch.load(path)["a"], torch.arange(3))
    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"a": torch.ones(2), "bad": _Unpicklable()}, path)
    assert torch.equal(torch.load(path)["a"], torch.arange(3))  # old file intact
    assert [p.name for p in path.parent.iterdir()] == ["x.pt"]  # no temporary left


def test_save_checkpoint_keeps_newest_and_ignores_temporaries(tmp_path):
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    (tmp_path / "checkpoints" / ".step-000000020.pt.123.tmp").write_bytes(b"torn")
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        checkpoint_path(tmp_path, 10).name, checkpoint_path(tmp_path, 15).name]
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 15
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_rng_state_round_trip():
    state = rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def _steps(sampler, n=None):
    out = []
    for i, micro in enumerate(sampler):
        out.append(torch.cat(micro))
        if n is not None and i + 1 == n:
            break
    return out


def test_sampler_global_batches_do_not_depend_on_world_size():
    # 1 worker x 4 micro-steps, 2 workers x 2, 4 workers x 1: same samples per step.
    def global_batches(world, micro):
        per_rank = [_steps(GlobalBatchSampler(100, 32, micro, world, r, seed=3))
                    for r in range(world)]
        return [torch.sort(torch.cat([p[s] for p in per_rank])).values
                for s in range(len(per_rank[0]))]

    ref = global_batches(1, 8)
    assert len(ref) == 3  # 100 // 32, the last partial batch dropped
    for world, micro in ((2, 8), (4, 8), (2, 16)):
        got = global_batches(world, micro)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert len(torch.cat(ref).unique()) == 96  # no sample twice in an epoch


def test_sampler_seeded_reshuffled_and_resumable():
    a = GlobalBatchSampler(50, 10, 5, 1, 0, seed=1)
    b = GlobalBatchSampler(50, 10, 5, 1, 0, seed=1)
    c = GlobalBatchSampler(50, 10, 5, 1, 0, seed=2)
    first = _steps(a)
    assert all(torch.equal(x, y) for x, y in zip(first, _steps(b), strict=True))
    assert not torch.equal(torch.cat(first), torch.cat(_steps(c)))
    a.next_epoch()
    assert not torch.equal(torch.cat(first), torch.cat(_steps(a)))  # a new order per epoch

    full = GlobalBatchSampler(50, 10, 5, 1, 0, seed=4)
    full.next_epoch()
    expected = _steps(full)
    part = GlobalBatchSampler(50, 10, 5, 1, 0, seed=4)
    part.next_epoch()
    _steps(part, 2)
    state = part.state_dict()
    assert state["position"] == 20  # counted as soon as a step is handed out
    resumed = GlobalBatchSampler(50, 10, 5, 1, 0, seed=0)
    resumed.load_state_dict(state)
    rest = _steps(resumed)
    assert all(torch.equal(x, y) for x, y in zip(expected[2:], rest, strict=True))
    assert resumed.epoch_done


def test_sampler_errors():
    with pytest.raises(ConfigError, match="larger than the training set"):
        GlobalBatchSampler(100, 128, 64, 2, 0)
    with pytest.raises(ConfigError, match="not a multiple"):
        GlobalBatchSampler(100, 30, 8, 2, 0)
    s = GlobalBatchSampler(100, 10, 10)
    with pytest.raises(ConfigError, match="99 training samples, this run has 100"):
        s.load_state_dict({"seed": 0, "epoch": 0, "position": 0, "num_samples": 99})


def test_sampler_batch_change_mid_epoch_keeps_position():
    s = GlobalBatchSampler(100, 20, 10, 1, 0, seed=5)
    perm = s.permutation(0)
    it = iter(s)
    first = torch.cat(next(it))
    s.set_batch(40, 20)  # e.g. an adaptive batch size doubled the batch
    second = torch.cat(next(it))
    assert torch.equal(first, perm[:20]) and torch.equal(second, perm[20:60])
    assert s.k_steps == 2 and s.position == 60 and s.steps_per_epoch == 2
    assert torch.equal(torch.cat(next(it)), perm[60:100]) and s.epoch_done


# ------------------------------------------------------------------ manifests and verification


def _three_checkpoints(tmp_path, keep=3):
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step, {"step": step, "w": torch.randn(64)}, keep=keep)
    return list_checkpoints(tmp_path)


def test_manifest_records_size_and_checksum(tmp_path):
    import hashlib
    import json

    from bigbatch.train.checkpoint import manifest_path, verify_checkpoint

    paths = _three_checkpoints(tmp_path, keep=2)
    assert [p.name for p in paths] == ["step-000000010.pt", "step-000000015.pt"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000000010.json", "step-000000010.pt", "step-000000015.json", "step-000000015.pt"]
    meta = json.loads(manifest_path(paths[-1]).read_text())
    data = paths[-1].read_bytes()
    assert meta["bytes"] == len(data) and meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert meta["step"] == 15 and verify_checkpoint(paths[-1]) is None


@pytest.mark.parametrize("damage, problem", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:], "checksum mismatch"),
    (lambda b: b"", "truncated"),
])
def test_corrupt_latest_falls_back_to_previous_with_one_warning(tmp_path, caplog, damage,
                                                               problem):
    paths = _three_checkpoints(tmp_path)
    paths[-1].write_bytes(damage(paths[-1].read_bytes()))
    with caplog.at_level("WARNING", logger="bigbatch"):
        assert latest_checkpoint(tmp_path) == paths[-2]
        assert latest_checkpoint(tmp_path) == paths[-2]  # warned once per process
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "step-000000015.pt is corrupt" in warnings[0] and problem in warnings[0]
    assert "using step-000000010.pt" in warnings[0]
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 10


def test_payload_without_manifest_is_skipped_unless_trusted(tmp_path):
    """A payload without its manifest was never committed (killed between the two renames,
    or put there by someone else): skipped; trusted, its zip CRCs decide."""
    from bigbatch.train.checkpoint import manifest_path

    paths = _three_checkpoints(tmp_path)
    manifest_path(paths[-1]).unlink()  # killed between the payload and the manifest rename
    assert latest_checkpoint(tmp_path, warn=False) == paths[-2]
    assert latest_checkpoint(tmp_path, trust=True) == paths[-1]
    paths[-1].write_bytes(paths[-1].read_bytes()[:-200])
    assert latest_checkpoint(tmp_path, trust=True) == paths[-2]
    for p in paths:
        p.write_bytes(b"garbage")
    assert latest_checkpoint(tmp_path, trust=True) is None


def test_save_failing_midway_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    from bigbatch.train.checkpoint import CheckpointSaveError

    paths = _three_checkpoints(tmp_path, keep=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    real_save = torch.save

    def disk_full(obj, f, *a, **kw):
        f.write(b"PK\x03\x04 partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointSaveError, match="No space left on device") as e:
        save_checkpoint(tmp_path, 20, {"step": 20}, keep=2)
    assert "step-000000020.pt" in str(e.value) and "kept step-000000015.pt" in str(e.value)
    assert "\n" not in str(e.value)
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    assert after == before  # nothing pruned, no temporary left, old bytes intact
    assert latest_checkpoint(tmp_path) == paths[-1]
    # Overwriting the same step fails midway too: that step's old payload still loads.
    with pytest.raises(CheckpointSaveError):
        save_checkpoint(tmp_path, 15, {"step": 15}, keep=2)
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 15


def test_cli_resume_skips_a_corrupt_latest_checkpoint(tmp_path, capsys, caplog, monkeypatch):
    from bigbatch.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path.parent / "xdg-cache-ckpt"))
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path / "run"
    args = ["train", "--nproc", "1", "--no-progress", "--no-tensorboard", "--out", str(out),
            "--task-opt", "num_samples=1000", "--model", "mlp", "--set",
            "batch.global_batch_size=64", "--set", "batch.warmup_epochs=0",
            "--checkpoint-every", "2"]
    try:
        assert main([*args, "--steps", "4"]) == 0
        latest = latest_checkpoint(out)
        assert latest.name == "step-000000004.pt"
        latest.write_bytes(latest.read_bytes()[:1000])
        capsys.readouterr()
        assert main([*args, "--steps", "6", "--resume"]) == 0
    finally:
        torch.set_num_threads(n)
    err = capsys.readouterr().err
    # (the warning goes to stderr too; under pytest the root logger's capture takes it)
    warned = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
    assert len(warned) == 1 and "step-000000004.pt" in warned[0], warned
    assert "resuming" in err and "from step 2" in err


@pytest.mark.parametrize("error, reason", [
    (RuntimeError("[enforce fail at inline_container.cc:820] . PytorchStreamWriter failed "
                  "writing file data/0: file write failed"), "PytorchStreamWriter failed"),
    (__import__("pickle").PicklingError("Can't pickle <function <lambda>>"), "Can't pickle"),
    (OSError(5, "Input/output error"), "Input/output error"),
], ids=["torch_runtime_error", "pickling_error", "os_error"])
def test_torch_save_errors_are_one_line_and_keep_the_previous_checkpoint(error, reason,
                                                                         tmp_path, monkeypatch):
    from bigbatch.train.checkpoint import CheckpointSaveError

    paths = _three_checkpoints(tmp_path, keep=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}

    def failing_save(obj, f, *a, **kw):
        f.write(b"PK\x03\x04 partial")
        raise error

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(CheckpointSaveError) as e:
        save_checkpoint(tmp_path, 20, {"step": 20}, keep=2)
    message = str(e.value)
    assert "\n" not in message and reason in message, message
    assert message.startswith("saving checkpoint step-000000020.pt failed (")
    assert message.endswith("; kept step-000000015.pt")
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    assert after == before  # no partial payload, no temporary file, nothing pruned
    assert latest_checkpoint(tmp_path) == paths[-1]


def test_load_errors_are_one_line(tmp_path):
    from bigbatch.train.checkpoint import CheckpointError, load_training_checkpoint

    path = tmp_path / "step-000000001.pt"
    for payload in (b"", b"not a zip", b"PK\x03\x04 truncated zip"):
        path.write_bytes(payload)
        with pytest.raises(CheckpointError, match=r"^checkpoint .* cannot be read: \w+") as e:
            load_training_checkpoint(path, trust=True)  # no manifest: trusted, then read
        assert "\n" not in str(e.value)
