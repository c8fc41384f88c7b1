"""Atomic checkpoints, RNG capture, and the resumable distributed batch sampler."""

import random

import numpy as np
import pytest
import torch

from bigbatch.checkpoint import (
    atomic_save,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from bigbatch.errors import ConfigError
from bigbatch.tasks.sampler import GlobalBatchSampler


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
