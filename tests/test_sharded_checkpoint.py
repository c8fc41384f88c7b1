"""Sharded (DCP) checkpoints in one process: every file in the manifest and checked
before a load, failed saves cleaned up, temporary folders recorded and removed, and
pruning that leaves another program's files alone. (The same through the real CLI on
2 ranks: tests/test_faults_sharded.py.)"""

import errno
import json
import logging

import pytest
import torch
from torch import nn

from bigbatch.parallel.world import World
from bigbatch.train.checkpoint import (
    CheckpointDamagedError,
    checkpoint_path,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from bigbatch.train.outdir import RunFiles, check_fresh
from bigbatch.train.sharded import (
    ShardedStateError,
    save_sharded,
    shard_problem,
    sharded_dir,
    temp_dir,
)
from bigbatch.train.verified import agree_on_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _save(out, step, files=None, keep=9):
    model, opt = _model()
    path = checkpoint_path(out, step)
    if files is not None:
        files.make_dir("checkpoints")
    shards = save_sharded(path, model, opt, True, files=files)
    save_checkpoint(out, step, {"step": step, "sharded": True}, keep=keep, files=files,
                    shards=shards)
    return path


def _said(caplog):
    return [r.getMessage() for r in caplog.records if r.name.startswith("bigbatch")]


def _shard(path):
    return next(p for p in sharded_dir(path).iterdir() if p.suffix == ".distcp")


def test_the_manifest_holds_every_file_of_a_sharded_checkpoint(tmp_path):
    path = _save(tmp_path, 2)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["format"] == 2 and meta["payload"] == path.name
    listed = sorted(meta["files"])
    assert listed == sorted(f"{path.stem}/{p.name}" for p in sharded_dir(path).iterdir())
    assert f"{path.stem}/.metadata" in listed and len(listed) >= 2
    assert verify_checkpoint(path) is None and shard_problem(path, 0, 1) is None


@pytest.mark.parametrize("damage, cheap, deep", [
    ("flip", None, "checksum mismatch"),
    ("truncate", "truncated: 10 bytes", None),
    ("delete", "missing", None),
    ("index", ".metadata checksum mismatch", None),
])
def test_each_damage_is_found_and_the_group_falls_back(damage, cheap, deep, tmp_path, caplog):
    """A flipped bit shows only in the digest (the workers' check, split over the ranks);
    a truncated, deleted or changed index shows in the one-process check already."""
    good, bad = _save(tmp_path, 2), _save(tmp_path, 4)
    shard = _shard(bad)
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:10])
    elif damage == "delete":
        shard.unlink()
    else:
        index = sharded_dir(bad) / ".metadata"
        data = bytearray(index.read_bytes())
        data[-5] ^= 1
        index.write_bytes(bytes(data))
    problem = verify_checkpoint(bad)
    assert (problem is None) if cheap is None else (cheap in problem), problem
    if deep is not None:
        assert shard_problem(bad, 0, 1) == f"{bad.stem}/{shard.name} {deep}"
        # two ranks split the files: one of them finds it, the other has nothing to say
        assert [shard_problem(bad, r, 2) is None for r in (0, 1)].count(False) == 1
        with caplog.at_level(logging.WARNING, logger="bigbatch"):
            assert agree_on_checkpoint(tmp_path, bad, World()) == good
        assert _said(caplog) == [
            f"warning: checkpoint {bad.name} is corrupt ({bad.stem}/{shard.name} "
            f"checksum mismatch); using {good.name}"]


def test_no_whole_checkpoint_left_is_one_error_line(tmp_path):
    for step in (2, 4):
        shard = _shard(_save(tmp_path, step))
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError) as e:
        agree_on_checkpoint(tmp_path, list_checkpoints(tmp_path)[-1], World())
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"--resume: no good checkpoint in {tmp_path / 'checkpoints'}: step-000000004.pt (")
    assert "step-000000002.pt (" in message and isinstance(e.value, OSError)


def test_pruning_leaves_a_user_file_in_a_dcp_folder(tmp_path, caplog):
    files = RunFiles(tmp_path)
    first = _save(tmp_path, 1, files, keep=2)
    notes = sharded_dir(first) / "notes.txt"
    notes.write_text("mine")
    _save(tmp_path, 2, files, keep=2)
    with caplog.at_level(logging.WARNING, logger="bigbatch"):
        _save(tmp_path, 3, files, keep=2)
    assert [p.name for p in sharded_dir(first).iterdir()] == ["notes.txt"]
    assert not first.exists() and notes.read_text() == "mine"
    assert _said(caplog) == [
        "note: kept checkpoints/step-000000001/ for notes.txt, which bigbatch did not write"]
    assert not any(rel.startswith("checkpoints/step-000000001") for rel in files.files)
    files.remove_all()  # --overwrite: every recorded file; the user's and its folder stay
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()
            and p.name != ".bigbatch-files.json"] == ["checkpoints/step-000000001/notes.txt"]


def test_pruning_without_a_record_removes_only_dcp_files(tmp_path):
    first = _save(tmp_path, 1, keep=1)
    (sharded_dir(first) / "notes.txt").write_text("mine")
    _save(tmp_path, 2, keep=1)
    assert [p.name for p in sharded_dir(first).iterdir()] == ["notes.txt"]


def test_a_failed_sharded_save_leaves_nothing_and_keeps_the_earlier_ones(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    files = RunFiles(tmp_path)
    kept = _save(tmp_path, 2, files)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
              and p.name != ".bigbatch-files.json"}

    def full_disk(state, checkpoint_id, **kw):
        checkpoint_id.mkdir(parents=True, exist_ok=True)
        (checkpoint_id / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    model, opt = _model()
    path = checkpoint_path(tmp_path, 4)
    with pytest.raises(ShardedStateError) as e:
        save_sharded(path, model, opt, True, files=files)
    assert e.value.reason == "No space left on device" and e.value.everywhere
    assert not temp_dir(sharded_dir(path)).exists() and not sharded_dir(path).exists()
    assert files.temp_dirs == set() and json.loads(
        (tmp_path / ".bigbatch-files.json").read_text())["temp_dirs"] == []
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
             and p.name != ".bigbatch-files.json"}
    assert after == before and list_checkpoints(tmp_path) == [kept]


def test_a_killed_saves_temporary_folder_is_bigbatchs_and_goes_at_the_next_start(tmp_path,
                                                                                 caplog):
    """Recorded before DCP writes in it: --overwrite does not refuse it, and any start
    removes it. One of an older bigbatch (not recorded) is known by its name and DCP's
    file names. Another program's file in one stays, with its folder."""
    files = RunFiles(tmp_path)
    _save(tmp_path, 2, files)
    recorded = temp_dir(sharded_dir(checkpoint_path(tmp_path, 4)))
    files.add_temp_dir(recorded)
    recorded.mkdir()
    (recorded / "__0_0.distcp").write_bytes(b"half")
    older = temp_dir(sharded_dir(checkpoint_path(tmp_path, 6)))
    older.mkdir()
    (older / "__1_0.distcp").write_bytes(b"half")
    (older / ".metadata.tmp").write_bytes(b"half")
    assert check_fresh(tmp_path, overwrite=True) is not None  # not refused
    files = RunFiles.read(tmp_path)
    files.begin()
    assert not recorded.exists() and not older.exists() and files.temp_dirs == set()

    files.add_temp_dir(recorded)
    recorded.mkdir()
    (recorded / "__0_0.distcp").write_bytes(b"half")
    (recorded / "mine.txt").write_text("mine")
    with pytest.raises(Exception, match="mine.txt, which bigbatch did not write"):
        check_fresh(tmp_path, overwrite=True)
    with caplog.at_level(logging.WARNING, logger="bigbatch"):
        files.begin()
    assert [p.name for p in recorded.iterdir()] == ["mine.txt"]
    assert _said(caplog) == [
        f"note: kept checkpoints/{recorded.name}/ for mine.txt, which bigbatch did not write"]


STAGE3 = """
[batch]
global_batch_size = 16
base_batch_size = 16
warmup_steps = 0

[sharding]
stage = 3
"""


@pytest.mark.usefixtures("train_env")
def test_the_main_job_says_what_failed_where_and_the_space_left(tmp_path, monkeypatch):
    """ZeRO-3 in one process (DCP without a group): a sharded save that fails is one line,
    its partial folder gone; a load that fails after the checks is one line too."""
    import torch.distributed.checkpoint as dcp

    from bigbatch.config.strategy import Strategy
    from bigbatch.train.checkpoint import CheckpointSaveError
    from bigbatch.train.trainer import TrainConfig, train

    out = tmp_path / "run"
    config = TrainConfig(task="charlm", task_options={"seq_len": 16, "d_model": 32,
                                                      "n_layer": 1, "n_head": 2},
                         steps=4, out=str(out), checkpoint_every=2, progress=False,
                         tensorboard=False)
    real, calls = dcp.save, []

    def second_fails(state, checkpoint_id, **kw):
        calls.append(1)
        if len(calls) == 2:
            checkpoint_id.mkdir(parents=True, exist_ok=True)
            (checkpoint_id / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(state, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(dcp, "save", second_fails)
    with pytest.raises(CheckpointSaveError) as e:
        train(config, Strategy.from_toml(STAGE3))
    assert str(e.value).startswith("saving checkpoint step-000000004/ failed (No space left "
                                   "on device; ")
    assert str(e.value).endswith(f"free in {out / 'checkpoints'}); kept step-000000002.pt")
    assert [p.name for p in list_checkpoints(out)] == ["step-000000002.pt"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000000002", "step-000000002.json", "step-000000002.pt"]
    monkeypatch.setattr(dcp, "save", real)

    def unreadable(*a, **kw):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(dcp, "load", unreadable)
    with pytest.raises(ShardedStateError, match=r"^loading checkpoint step-000000002/ failed "
                                                r"\(Input/output error\)$"):
        train(TrainConfig(**{**config.to_dict(), "resume": True}), Strategy.from_toml(STAGE3))
