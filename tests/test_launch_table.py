"""The launch table (Fleet's "Distributed Envs"): every rank's rank, local rank, node, host,
process and device, gathered once, in the run's header and in `run.json`."""

from __future__ import annotations

import json
import os

import pytest

from bigbatch.parallel.world import World
from bigbatch.train.launch_table import gather_launch, launch_lines


def test_one_process_table(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    launch = gather_launch(World())
    assert launch["world_size"] == 1 and launch["endpoint"] is None
    row = launch["ranks"][0]
    assert (row["rank"], row["local_rank"], row["device"]) == ("0", "0", "cpu")
    assert row["pid"] == str(os.getpid())
    lines = launch_lines(launch)
    assert lines[0] == "launch: world size 1, rendezvous endpoint none (one process)"
    assert lines[1].split() == ["rank", "local_rank", "node", "host", "pid", "device"]
    assert lines[2].split()[0] == "0" and len(lines) == 3


@pytest.mark.slow  # ~17 s: torchrun starts 2 training processes through the CLI
def test_cli_header_and_run_json_list_both_ranks(tmp_path):
    from tests._cli import TINY, run_cli

    out = tmp_path / "run"
    p = run_cli(["train", "--nproc", "2", *TINY, "--steps", "1", "--out", str(out)],
                tmp_path / "cache")
    assert p.returncode == 0, p.stderr[-3000:]
    text = p.stdout + p.stderr
    title = next(line for line in text.splitlines() if line.startswith("launch: "))
    assert title.startswith("launch: world size 2, rendezvous endpoint 127.0.0.1:"), title
    launch = json.loads((out / "run.json").read_text())["launch"]
    assert launch["world_size"] == 2 and launch["endpoint"] in title
    assert [r["rank"] for r in launch["ranks"]] == ["0", "1"]
    assert [r["local_rank"] for r in launch["ranks"]] == ["0", "1"]
    assert len({r["pid"] for r in launch["ranks"]}) == 2
    for r in launch["ranks"]:  # one table row per rank, in the header
        assert any(line.split()[:2] == [r["rank"], r["local_rank"]] and r["pid"] in line
                   for line in text.splitlines()), text[-2000:]
