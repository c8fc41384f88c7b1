"""A policy switches the reduce to PowerSGD through a checkpoint (issue 40: "policies may
change the reduction ... through a checkpoint otherwise"): `Policies.request_relaunch`
stops the run after a checkpoint, and `bigbatch train`'s launcher resumes it with
``--resume --set data_parallel.reduce=powersgd`` (`bigbatch.cli.relaunch`; the
autoscaler's segments too). The pieces on their own, then (slow) a real 2-worker job
that equals the same switch made by hand, bit for bit (docs/policies.md)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bigbatch.cli.relaunch import relaunch_requested, run_relaunching
from bigbatch.config.fields import format_literal, parse_literal
from bigbatch.engine.policies import Policies
from bigbatch.errors import PolicyError
from bigbatch.parallel.data_parallel import CommState
from bigbatch.train.stopped import STOPPED_FILE, write_stopped


@pytest.mark.parametrize("value", ["powersgd", "a b", "x:y", "true", True, 3, 0.25,
                                   ["straggler", "tests.user_policies:X"], [1, 2.5]])
def test_set_values_read_back(value):
    assert parse_literal(format_literal(value)) == value
    assert format_literal("powersgd") == "powersgd"


def test_a_relaunch_request_is_a_stop_with_the_flags():
    p = Policies([])
    p.request_relaunch({"data_parallel.reduce": "powersgd"}, "compress")
    assert p.relaunch == {"data_parallel.reduce": "powersgd"}
    message, status = p.stop
    assert status == 0
    assert message == "compress; resume with --resume --set data_parallel.reduce=powersgd"
    for bad in ({}, {"reduce": "powersgd"}, {"data_parallel.reduce": object()},
                {"data_parallel.reduce": {"a": 1}}):
        with pytest.raises(PolicyError, match="request_relaunch"):
            Policies([]).request_relaunch(bad, "x")
    # a stop already asked for wins: no relaunch on top of it
    p = Policies([])
    p.request_stop("done", 75)
    p.request_relaunch({"data_parallel.reduce": "powersgd"}, "compress")
    assert p.stop == ("done", 75) and p.relaunch is None


def test_the_memory_of_another_reduce_is_not_loaded():
    class Local:  # local SGD's counters, say
        def __init__(self):
            self.loaded = None

        def state_dict(self):
            return {"step": 3}

        def load_state_dict(self, state):
            self.loaded = state

    saved = CommState(None, Local(), False).state_dict()
    assert saved == {"inner": {"step": 3}, "kind": "Local"}
    other = CommState(None, object(), False)  # e.g. PowerSGD's state: no load_state_dict
    other.load_state_dict(saved)  # left out, not an AttributeError
    same = CommState(None, Local(), False)
    same.load_state_dict(saved)
    assert same.inner_state.loaded == {"step": 3}
    old = CommState(None, Local(), False)  # a checkpoint from before the kind was saved
    old.load_state_dict({"inner": {"step": 5}})
    assert old.inner_state.loaded == {"step": 5}


def _fake_job(out: Path, requests: list[dict | None]):
    """A launch that, instead of training, records its command line and writes the next
    of `requests` as its stop's relaunch keys (None: the run ends)."""
    calls = []

    def launch(args, argv, config, strategy):
        calls.append((list(argv), list(args.overrides), args.resume))
        keys = requests[len(calls) - 1]
        if keys is not None:
            time.sleep(0.02)  # past the launcher's clock, as any real launch is
            write_stopped(out, "switch", 0, 6 * len(calls), relaunch=keys)
        return 0

    return launch, calls


def test_the_launcher_resumes_with_the_keys(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    launch, calls = _fake_job(out, [{"data_parallel.reduce": "powersgd",
                                     "data_parallel.start_powersgd_iter": 2}, None])
    resolved = []

    def resolve(args):
        resolved.append(list(args.overrides))
        return SimpleNamespace(out=str(out)), None

    args = argparse.Namespace(overrides=["batch.base_lr=0.1"], resume=False, overwrite=True)
    argv = ["train", "--overwrite", "--set", "batch.base_lr=0.1"]
    assert run_relaunching(args, argv, SimpleNamespace(out=str(out)), None, resolve,
                           launch) == 0
    assert len(calls) == 2 and calls[0][0] == argv
    sets = ["data_parallel.reduce=powersgd", "data_parallel.start_powersgd_iter=2"]
    assert calls[1][0] == ["train", "--set", "batch.base_lr=0.1", "--resume",
                           "--set", sets[0], "--set", sets[1]]
    assert calls[1][1:] == (["batch.base_lr=0.1", *sets], True)
    assert resolved == [["batch.base_lr=0.1", *sets]]
    err = capsys.readouterr().err
    assert ("relaunching from the checkpoint at step 6 with --set data_parallel.reduce="
            "powersgd --set data_parallel.start_powersgd_iter=2") in err
    # taken once: the stop now says what was done, and is not followed again
    stopped = json.loads((out / STOPPED_FILE).read_text())
    assert "relaunch" not in stopped and stopped["relaunched"]["data_parallel.reduce"] == (
        "powersgd")
    assert relaunch_requested(out, 0.0) is None


def test_an_autoscaled_segment_relaunches_at_its_size(tmp_path):
    from bigbatch.cli.autoscale import add_autoscale_arguments, run_autoscaled

    out = tmp_path / "run"
    out.mkdir()
    launch, calls = _fake_job(out, [{"data_parallel.reduce": "powersgd"}, None, None])

    def resolve(args):
        return SimpleNamespace(out=str(out)), SimpleNamespace(
            batch=SimpleNamespace(base_batch_size=16))

    parser = argparse.ArgumentParser()
    add_autoscale_arguments(parser)
    args = parser.parse_args([])
    args.out, args.resume, args.overwrite, args.overrides = str(out), False, False, []
    args.nnodes = args.rdzv_endpoint = None
    sizes = []

    def sized(a, argv, config, strategy):
        sizes.append(a.nproc)
        return launch(a, argv, config, strategy)

    # no measurement is written: the second launch (the relaunch) ends the run
    assert run_autoscaled(args, ["train"], 1, 2, resolve, sized) == 0
    assert sizes == [1, 1]
    assert calls[1][0] == ["train", "--set", "data_parallel.reduce=powersgd", "--resume"]


def test_the_monitor_shows_the_relaunch(tmp_path):
    from rich.console import Console

    from bigbatch.train.monitor import read_run, render

    lines = [{"kind": "train", "step": 6, "loss": 1.0},
             {"kind": "relaunch", "step": 6, "set": {"data_parallel.reduce": "powersgd"},
              "reason": "compress"},
             {"kind": "train", "step": 7, "loss": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    view = read_run(tmp_path)
    assert view.skipped == 0 and len(view.relaunches) == 1
    console = Console(width=160, record=True)
    console.print(render(view))
    assert ("step 6: relaunched with data_parallel.reduce = powersgd (compress)"
            in console.export_text())


STRATEGY = """
[batch]
global_batch_size = 64
base_batch_size = 32
base_lr = 0.05
warmup_steps = 2

[optimizer]
type = "momentum"

[data_parallel]
start_powersgd_iter = 2

[adaptive]
policies = ["tests.user_policies:CompressAt6"]
"""


def _args(cfg: Path, out: Path, *more: str) -> list[str]:
    return ["train", "--config", str(cfg), "--task", "mnist1d", "--model", "mlp",
            "--task-opt", "num_samples=1000", "--steps", "14", "--checkpoint-every", "100",
            "--no-progress", "--no-tensorboard", "--nproc", "2", "--out", str(out), *more]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    state = torch.load(out / "final.pt", weights_only=True)
    return state.get("model", state)


@pytest.mark.slow  # ~75 s on 2 cores: 5 launches of 2 gloo workers
def test_a_policy_switches_to_powersgd_through_a_checkpoint(tmp_path):
    import shutil

    from _cli import run_cli

    cfg = tmp_path / "s.toml"
    cfg.write_text(STRATEGY)
    auto = tmp_path / "auto"
    p = run_cli(_args(cfg, auto), tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    assert ("relaunching from the checkpoint at step 6 with --set "
            "data_parallel.reduce=powersgd") in p.stderr
    lines = [json.loads(x) for x in (auto / "metrics.jsonl").read_text().splitlines()]
    switch = [x for x in lines if x["kind"] == "relaunch"]
    assert switch == [{"kind": "relaunch", "step": 6,
                       "set": {"data_parallel.reduce": "powersgd"},
                       "reason": "compress: asked by the test at step 6; resume with "
                                 "--resume --set data_parallel.reduce=powersgd"}]
    assert max(x["step"] for x in lines if x["kind"] == "train") == 14
    assert 'reduce = "powersgd"' in (auto / "strategy.toml").read_text()

    # The same switch by hand: stop at step 6, resume with the flag.
    hand = tmp_path / "hand"
    p = run_cli(_args(cfg, hand), tmp_path, timeout=300, BIGBATCH_TEST_STOP_ONLY="1")
    assert p.returncode == 0, p.stderr
    assert "relaunching" not in p.stderr
    kept = tmp_path / "kept"
    shutil.copytree(hand, kept)
    p = run_cli(_args(cfg, hand, "--resume", "--set", "data_parallel.reduce=powersgd"),
                tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    a, b = _weights(auto), _weights(hand)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    # PowerSGD was in force after the switch: the run kept at all-reduce ends elsewhere.
    p = run_cli(_args(cfg, kept, "--resume"), tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    c = _weights(kept)
    assert any(not torch.equal(a[k], c[k]) for k in a)
