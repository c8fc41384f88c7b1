"""Loading never executes code: a crafted pickle in each file bigbatch reads back (a
single-file checkpoint, one without its manifest, a sharded checkpoint's DCP index and
shards, a `run.save_state` folder) is refused in one line, its code never runs (the
marker file it would create stays absent) and nothing is written; checkpoints of
earlier versions (numpy RNG arrays) still load, as data."""

import hashlib
import json
import pickle
import random
import shutil

import numpy as np
import pytest
import torch

from bigbatch.cli.main import main
from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.engine.safe_load import dcp_load, load_plain
from bigbatch.engine.saving import rng_state, set_rng_state
from bigbatch.errors import ConfigError, UntrustedFileError
from bigbatch.parallel.world import World
from bigbatch.train.checkpoint import (
    CheckpointSaveError,
    atomic_save,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    manifest_path,
    save_checkpoint,
    write_text_atomic,
)
from bigbatch.train.manifest import write_manifest
from tests._cli import TINY, snapshot

pytestmark = pytest.mark.usefixtures("train_env")


class Payload:
    """Unpickled, it creates `marker`: what an attacker's file would run instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def _craft(path, marker, wrap=lambda p: {"format": 2, "step": 2, "x": p}):
    torch.save(wrap(Payload(marker)), path)


def _vouch(payload, rel=None):
    """Rewrite `payload`'s manifest so that it matches whatever the file now holds (what
    anyone who can write the payload can do): only the loader can refuse it then."""
    meta = json.loads(manifest_path(payload).read_text())
    target = payload if rel is None else payload.parent / rel
    data = target.read_bytes()
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if rel is None:
        meta.update(entry)
    else:
        meta["files"][rel] = entry
    manifest_path(payload).write_text(json.dumps(meta))


def test_the_crafted_payload_really_runs_code_when_unpickled(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))  # noqa: S301 - the point of the test
    assert marker.exists()


def _cli(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


ARGS = ["train", "--nproc", "1", *TINY, "--steps", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished 2-step run, whole-model and sharded (each a few seconds), to copy."""
    base = tmp_path_factory.mktemp("safe-load")
    cache = tmp_path_factory.getbasetemp() / "xdg-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        for name, extra in (("whole", []), ("sharded", ["--set", "sharding.enable=true"])):
            assert main([*ARGS, *extra, "--out", str(base / name)]) == 0
    return base


def _copy(runs, name, tmp_path):
    out = tmp_path / name
    shutil.copytree(runs / name, out)
    return out, latest_checkpoint(out, warn=False)


def _refused(argv, out, marker, expected, capsys):
    before = snapshot(out)
    code, err = _cli(argv, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err
    assert not marker.exists()
    assert snapshot(out) == before  # nothing written, nothing deleted


def test_a_crafted_checkpoint_is_refused_by_resume(runs, tmp_path, capsys):
    out, ckpt = _copy(runs, "whole", tmp_path)
    marker = tmp_path / "ran"
    _craft(ckpt, marker)
    _vouch(ckpt)
    _refused([*ARGS, "--out", str(out), "--resume", "--steps", "3"], out, marker,
             f"checkpoint {ckpt.name} holds a pickled exec", capsys)
    _refused([*ARGS, "--out", str(out), "--resume", "--steps", "3", "--trust-checkpoint"], out,
             marker, "holds a pickled exec", capsys)  # trust never builds objects
    with pytest.raises(UntrustedFileError, match="refused unread"):
        load_checkpoint(ckpt)  # the API alike
    assert not marker.exists()


def test_a_checkpoint_without_manifest_is_refused_unless_trusted(runs, tmp_path, capsys):
    out, ckpt = _copy(runs, "whole", tmp_path)
    manifest_path(ckpt).unlink()
    marker = tmp_path / "ran"
    _refused([*ARGS, "--out", str(out), "--resume", "--steps", "3"], out, marker,
             f"checkpoint {ckpt.name} has no manifest", capsys)
    with pytest.raises(UntrustedFileError, match="no manifest"):
        load_checkpoint(ckpt)
    genuine = ckpt.read_bytes()
    _craft(ckpt, marker)
    _refused([*ARGS, "--out", str(out), "--resume", "--steps", "3", "--trust-checkpoint"], out,
             marker, "holds a pickled exec", capsys)
    ckpt.write_bytes(genuine)  # the user knows where it came from: it resumes
    code, err = _cli([*ARGS, "--out", str(out), "--resume", "--steps", "3",
                      "--trust-checkpoint"], capsys)
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_a_checkpoint_that_does_not_match_its_manifest_is_not_loaded(runs, tmp_path):
    out, ckpt = _copy(runs, "whole", tmp_path)
    _craft(ckpt, tmp_path / "ran")  # the manifest still names the genuine payload
    with pytest.raises(UntrustedFileError, match="does not match its manifest"):
        load_checkpoint(ckpt)
    assert latest_checkpoint(out, warn=False) is None  # and no resume picks it
    assert not (tmp_path / "ran").exists()


def test_a_crafted_dcp_index_is_refused_by_resume(runs, tmp_path, capsys):
    out, ckpt = _copy(runs, "sharded", tmp_path)
    marker = tmp_path / "ran"
    index = ckpt.with_suffix("") / ".metadata"
    index.write_bytes(pickle.dumps(Payload(marker)))  # DCP's index is a plain pickle
    _vouch(ckpt, f"{ckpt.stem}/.metadata")
    _refused([*ARGS, "--set", "sharding.enable=true", "--out", str(out), "--resume",
              "--steps", "3"], out, marker, "names builtins.exec, not DCP's index types",
             capsys)


def test_a_crafted_entry_in_a_dcp_shard_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    with pytest.warns(UserWarning):  # DCP: "torch.distributed is disabled" (one process)
        dcp.save({"w": torch.ones(2), "extra": Payload(marker)}, checkpoint_id=tmp_path / "s",
                 no_dist=True)
    state = {"w": torch.zeros(2), "extra": None}
    with pytest.raises(UntrustedFileError, match="'extra' of a DCP shard holds a pickled exec"):
        dcp_load(state, tmp_path / "s")
    assert not marker.exists()


# ------------------------------------------------------------------ run.save_state


@pytest.fixture
def run():
    torch.manual_seed(0)
    return prepare(torch.nn.Linear(4, 2), Strategy(), total_steps=4, world=World())


@pytest.mark.parametrize("name", ["run.pt", "rng-0.pt", "model.pt"])
def test_a_crafted_save_state_file_is_refused(run, tmp_path, name):
    state, marker = tmp_path / "state", tmp_path / "ran"
    run.save_state(state, extra={"epoch": 1})
    _craft(state / name, marker)
    weights = {k: v.clone() for k, v in run.module.state_dict().items()}
    with pytest.raises(UntrustedFileError) as e:
        run.load_state(state)
    message = str(e.value)
    assert "\n" not in message and f"{name} holds a pickled exec" in message
    assert not marker.exists()
    assert all(torch.equal(v, run.module.state_dict()[k]) for k, v in weights.items())


def test_a_crafted_dcp_index_in_a_sharded_save_state_is_refused(tmp_path):
    torch.manual_seed(0)
    strategy = Strategy.from_dict({"sharding": {"enable": True, "stage": 3}})
    run = prepare(torch.nn.Linear(4, 2), strategy, total_steps=4, world=World())
    state, marker = tmp_path / "state", tmp_path / "ran"
    run.save_state(state)
    (state / "model" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UntrustedFileError, match=r"model/.metadata names builtins.exec"):
        run.load_state(state)
    assert not marker.exists()


def test_save_state_refuses_extra_it_could_not_read_back(run, tmp_path):
    with pytest.raises(ConfigError, match=r"extra\['step'\] is a numpy.float64"):
        run.save_state(tmp_path / "state", extra={"step": np.float64(3.0)})
    assert not any(tmp_path.iterdir())


def test_a_checkpoint_state_that_could_not_be_read_back_is_not_saved(tmp_path):
    with pytest.raises(CheckpointSaveError, match=r"\['rng'\]\[0\] is a numpy.ndarray"):
        save_checkpoint(tmp_path, 1, {"step": 1, "rng": [np.zeros(3)]})
    assert not (tmp_path / "checkpoints").exists() or not any(
        (tmp_path / "checkpoints").iterdir())


# ------------------------------------------------------------------ RNG states, old and new


def _draws():
    return torch.rand(3), np.random.rand(3), random.random()


def _same(a, b):
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_rng_state_is_plain_data(tmp_path):
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = _draws()
    state = torch.load(tmp_path / "rng.pt", weights_only=True)  # torch's own: no numpy
    set_rng_state(state)
    assert _same(expected, _draws())


def test_an_old_checkpoint_with_numpy_rng_arrays_loads_as_data(tmp_path):
    """Checkpoints written before this version pickled numpy's and python's getstate():
    they still load, weights-only (numpy arrays as data, nothing called), and resume
    the same streams."""
    old = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
           "python": random.getstate()}
    expected = _draws()
    path = checkpoint_path(tmp_path, 1)
    atomic_save({"step": 1, "rng": [old]}, path)  # as the earlier version wrote it
    write_manifest(path, 1, None, write_text_atomic)
    loaded = load_checkpoint(latest_checkpoint(tmp_path))
    assert isinstance(loaded["rng"][0]["numpy"][1], np.ndarray)
    set_rng_state(loaded["rng"][0])
    assert _same(expected, _draws())
    assert load_plain(path.read_bytes(), "x")["step"] == 1
