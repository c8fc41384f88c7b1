"""Deletion stays inside --out: `bigbatch train --overwrite` (and every start, which removes
leftover temporary files) deletes only paths that resolve inside --out after symlinks.
A run record naming anything else (`../x`, an absolute path, `../dir/`, a file behind a
symlink out of --out) is refused in one line, exit 2, before anything is deleted.

Runs `bigbatch.cli.main.main` in this process; one finished run is trained for the
module and copied for each test."""

import json
import os
import shutil
from pathlib import Path

import pytest

from bigbatch.cli.main import main
from tests._cli import TINY, assert_error_line, snapshot

RUN = ["train", "--nproc", "1", *TINY, "--steps", "4", "--checkpoint-every", "2"]
RECORD = ".bigbatch-files.json"

pytestmark = pytest.mark.usefixtures("train_env")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run's directory (trained once for the module)."""
    out = tmp_path_factory.mktemp("confined") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
            mp.delenv(name, raising=False)
        assert main([*RUN, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_dir(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    return out


def _record(out: Path, **extra: list[str]) -> None:
    record = json.loads((out / RECORD).read_text())
    for key, entries in extra.items():
        record[key] = sorted({*record[key], *entries})
    (out / RECORD).write_text(json.dumps(record))


def _victims(root: Path) -> dict[str, Path]:
    """Files and a folder outside --out that a bad record names."""
    (root / "victim.txt").write_text("the user's\n")
    (root / "victim_dir").mkdir()
    return {"file": root / "victim.txt", "dir": root / "victim_dir"}


def _overwrite(capsys, out: Path) -> tuple[int, str]:
    capsys.readouterr()
    code = main([*RUN, "--out", str(out), "--overwrite"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", ["dotdot", "absolute", "dotdot_dir", "symlink_file",
                                  "symlinked_folder"])
def test_a_record_naming_a_path_out_of_out_deletes_nothing(run_dir, tmp_path, case, capsys):
    victims = _victims(tmp_path)
    if case == "dotdot":
        entry = "../victim.txt"
        _record(run_dir, files=[entry])
    elif case == "absolute":
        entry = str(victims["file"])
        _record(run_dir, files=[entry])
    elif case == "dotdot_dir":
        entry = "../victim_dir/"
        _record(run_dir, dirs=[entry])
    elif case == "symlink_file":  # a recorded name that is now a link to the user's file
        entry = "final.pt"
        (run_dir / entry).unlink()
        (run_dir / entry).symlink_to(victims["file"])
    else:  # checkpoints/ moved elsewhere and linked back: its files resolve outside
        elsewhere = tmp_path / "elsewhere" / "checkpoints"
        elsewhere.parent.mkdir()
        shutil.move(run_dir / "checkpoints", elsewhere)
        (run_dir / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
        entry = "checkpoints"
    before = snapshot(tmp_path)
    code, err = _overwrite(capsys, run_dir)
    assert code == 2, err
    assert_error_line(err, f"{RECORD} names {entry!r}")
    assert "deleted nothing" in err
    assert snapshot(tmp_path) == before  # nothing inside or outside --out changed
    assert victims["file"].read_text() == "the user's\n" and victims["dir"].is_dir()


def test_a_resume_is_refused_alike(run_dir, tmp_path, capsys):
    _victims(tmp_path)
    _record(run_dir, files=["../victim.txt"])
    before = snapshot(tmp_path)
    capsys.readouterr()
    code = main([*RUN, "--out", str(run_dir), "--resume", "--steps", "6"])
    err = capsys.readouterr().err
    assert code == 2
    assert_error_line(err, f"{RECORD} names '../victim.txt', which leads out of --out")
    assert snapshot(tmp_path) == before


def test_links_in_out_that_bigbatch_did_not_write_keep_their_targets(run_dir, tmp_path,
                                                                     capsys):
    """A link named like a leftover temporary file, and a linked folder, pointing out of
    --out: the run replaces its own files and leaves the links and their targets."""
    victims = _victims(tmp_path)
    (victims["dir"] / ".step-000000002.tmp").mkdir()
    (victims["dir"] / ".step-000000002.tmp" / "__0_0.distcp").write_bytes(b"user's")
    (run_dir / ".summary.json.4242.tmp").symlink_to(victims["file"])
    (run_dir / "checkpoints" / ".step-000000002.tmp").symlink_to(
        victims["dir"] / ".step-000000002.tmp", target_is_directory=True)
    (run_dir / "data").symlink_to(victims["dir"], target_is_directory=True)
    outside = snapshot(victims["dir"])
    code, err = _overwrite(capsys, run_dir)
    assert code == 0, err
    assert victims["file"].read_text() == "the user's\n"
    assert snapshot(victims["dir"]) == outside
    assert os.path.islink(run_dir / "data")
    assert os.path.islink(run_dir / ".summary.json.4242.tmp")
