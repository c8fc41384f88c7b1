"""`run.save_state` deletes only what it wrote: replacing a saved state never takes a file
another program put in it, a leftover `.NAME.tmp` / `.NAME.old` beside it is removed only
when bigbatch made it, and a symlink at one of those names is never followed."""

import pytest
import torch

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError, SaveStateError
from bigbatch.parallel.world import World
from tests._cli import snapshot


@pytest.fixture
def run():
    torch.manual_seed(0)
    return prepare(torch.nn.Linear(4, 2), Strategy(), total_steps=4, world=World())


def test_a_state_holding_a_users_file_is_not_replaced(run, tmp_path):
    state = tmp_path / "state"
    run.save_state(state, extra={"epoch": 1})
    run.save_state(state, extra={"epoch": 2})  # its own files only: replaced
    assert run.load_state(state) == {"epoch": 2}
    (state / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"it holds notes.txt, which bigbatch did not write"):
        run.save_state(state, extra={"epoch": 3})
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", [".state.tmp", ".state.old"])
@pytest.mark.parametrize("kind", ["folder", "symlink"])
def test_a_leftover_name_bigbatch_did_not_make_is_refused(run, tmp_path, name, kind):
    state = tmp_path / "state"
    run.save_state(state, extra={"epoch": 1})
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.bin").write_bytes(b"the user's")
    if kind == "folder":
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.bin").write_bytes(b"the user's")
    else:
        (tmp_path / name).symlink_to(victim, target_is_directory=True)
    before = snapshot(tmp_path)
    with pytest.raises(SaveStateError, match=rf"{name} exists and bigbatch did not make it"):
        run.save_state(state, extra={"epoch": 2})
    assert snapshot(tmp_path) == before
    assert run.load_state(state) == {"epoch": 1}


def test_an_interrupted_saves_own_leftover_is_removed(run, tmp_path):
    state = tmp_path / "state"
    run.save_state(state, extra={"epoch": 1})
    leftover = tmp_path / ".state.tmp"
    leftover.mkdir()  # what a save killed after its first moment leaves
    (leftover / "bigbatch-state.json").write_text("{}\n")
    (leftover / "model.pt").write_bytes(b"partial")
    run.save_state(state, extra={"epoch": 2})
    assert run.load_state(state) == {"epoch": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
