"""`bigbatch.Policy`: hooks, loading by name, state across a resume, errors that name the policy,
and the built-in noise_scale_doubling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_engine import ONE, make_data, make_model, strategy

import bigbatch
import bigbatch.train.trainer as T
from bigbatch.adaptive.doubling import NoiseScaleDoubler
from bigbatch.cli.main import main
from bigbatch.config.strategy import Strategy
from bigbatch.engine import prepare
from bigbatch.errors import ConfigError, PolicyError
from bigbatch.train.trainer import TrainConfig, train
from tests.user_policies import NotAPolicy

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"num_samples": 1000}  # 800 train samples: 12 steps of 64 per epoch
STRATEGY = """
[batch]
global_batch_size = 64
micro_batch_size = 32
base_batch_size = 32
base_lr = 0.05
warmup_steps = 2

[gradient_merge]
k_steps = 2

[adaptive]
policies = ["tests.user_policies:DoubleAtEpoch2"]
"""


def _config(out, **kw):
    base = dict(task="mnist1d", model="mlp", task_options=SMALL, epochs=3, out=str(out),
                checkpoint_every=5, log_every=1, progress=False, tensorboard=False)
    return TrainConfig(**{**base, **kw})


def _lines(out, kind):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _policy_state(out):
    from bigbatch.train.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = load_checkpoint(latest_checkpoint(out))
    return ckpt["engine"]["extra"]["policies"]


@pytest.mark.usefixtures("train_env")
def test_user_policy_doubles_the_batch_at_epoch_2_and_resume_keeps_its_state(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    summary = train(_config(full), Strategy.from_toml(STRATEGY))
    batch = {r["step"]: r["global_batch_size"] for r in _lines(full, "train")}
    # Epoch 1: 12 steps of 64; epochs 2 and 3: 6 steps of 128 each (the same samples).
    assert batch == {s: 64 if s <= 12 else 128 for s in range(1, 25)}
    assert summary["steps"] == 24 and summary["samples"] == 3 * 768
    change, = _lines(full, "batch_size")
    assert (change["step"], change["old"], change["new"], change["k_steps"]) == (12, 64, 128, 4)
    assert "DoubleAtEpoch2" in change["reason"] and summary["batch_size_changes"][0]["new"] == 128
    state = _policy_state(full)
    calls = state["policies"]["tests.user_policies:DoubleAtEpoch2"]["calls"]
    assert calls == [["before_train", 0], ["before_epoch", 1, 0], ["after_epoch", 1, 12],
                     ["before_epoch", 2, 12], ["after_epoch", 2, 18], ["before_epoch", 3, 18],
                     ["after_epoch", 3, 24], ["after_train", 24]]

    # Killed at its fifth checkpoint (the end of epoch 2): the latest is step 15, mid-epoch 2,
    # after the doubling. The resume neither doubles again nor repeats a hook.
    calls_made = []
    original = T.rng_state

    def crash():
        calls_made.append(1)
        if len(calls_made) == 5:
            raise KeyboardInterrupt
        return original()

    T.rng_state = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            train(_config(cut), Strategy.from_toml(STRATEGY))
    finally:
        T.rng_state = original
    assert _policy_state(cut)["epoch_begun"] == 2
    train(_config(cut, resume=True), Strategy.from_toml(STRATEGY))
    assert _policy_state(cut) == state
    assert {r["step"]: r["global_batch_size"] for r in _lines(cut, "train")} == batch
    a = torch.load(full / "final.pt", weights_only=True)
    b = torch.load(cut / "final.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("spec,message", [
    ("nope_pkg.mod:X", "policy 'nope_pkg.mod:X': cannot import nope_pkg.mod"),
    ("tests.user_policies:Missing", "module tests.user_policies has no Missing"),
    ("tests.user_policies:NotAPolicy", "NotAPolicy is not a subclass of bigbatch.Policy"),
    ("not a path", "'not a path' is neither a built-in policy"),
])
@pytest.mark.usefixtures("train_env")
def test_bad_policy_path_is_one_line_exit_2(spec, message, tmp_path, capsys):
    code = main(["train", "--nproc", "1", "--task-opt", "num_samples=1000", "--steps", "2",
                 "--out", str(tmp_path / "o"), "--no-progress", "--set",
                 "batch.global_batch_size=64", "--set", f'adaptive.policies=["{spec}"]'])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert message in err
    assert not (tmp_path / "o").exists()  # refused before anything is written


@pytest.mark.usefixtures("train_env")
def test_a_hook_that_raises_is_one_line_naming_the_policy(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(STRATEGY.replace("DoubleAtEpoch2", "Raises"))
    code = main(["train", "--nproc", "1", "--task-opt", "num_samples=1000", "--epochs", "1",
                 "--model", "mlp", "--out", str(tmp_path / "o"), "--no-progress",
                 "--config", str(tmp_path / "s.toml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == ("bigbatch train: error: policy 'tests.user_policies:Raises': after_epoch(1) "
                       "raised ValueError: no epochs for me")
    assert not any("Traceback" in line for line in err)


@pytest.mark.usefixtures("train_env")
def test_a_requested_stop_checkpoints_exits_with_its_status_and_resumes(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(STRATEGY.replace("DoubleAtEpoch2", "StopAt3"))
    argv = ["train", "--nproc", "1", "--task-opt", "num_samples=1000", "--steps", "5",
            "--model", "mlp", "--out", str(tmp_path / "o"), "--no-progress",
            "--config", str(tmp_path / "s.toml")]
    assert main(argv) == 75
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "bigbatch train: stop: asked by the test at step 3"
    assert (tmp_path / "o" / "checkpoints" / "step-000000003.pt").is_file()
    assert json.loads((tmp_path / "o" / "stopped.json").read_text())["status"] == 75
    assert main([*argv, "--resume"]) == 0  # past step 3 the policy lets it finish
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["steps"] == 5


@pytest.mark.slow  # ~25 s: torchrun and its two workers start from scratch
@pytest.mark.usefixtures("train_env")
def test_a_requested_stop_under_torchrun_gives_the_launcher_its_status(tmp_path):
    (tmp_path / "s.toml").write_text(STRATEGY.replace("DoubleAtEpoch2", "StopAt3")
                                     .replace("micro_batch_size = 32\n", ""))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "bigbatch", "train", "--nproc", "2",
                        "--task-opt", "num_samples=1000", "--steps", "5", "--model", "mlp",
                        "--out", str(tmp_path / "o"), "--no-progress", "--timeout", "60",
                        "--config", str(tmp_path / "s.toml")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    # The workers exit 0, so torchrun does not restart them; stopped.json carries the 75.
    assert p.returncode == 75, p.stderr[-3000:]
    assert p.stderr.count("stop: asked by the test at step 3") == 1  # rank 0's line
    assert (tmp_path / "o" / "checkpoints" / "step-000000003.pt").is_file()


# ---------------------------------------------------------------- the engine alone


class Recorder(bigbatch.Policy):
    name = "recorder"

    def __init__(self, stop_at=None):
        self.stats = []
        self.stop_at = stop_at

    def after_step(self, run, stats):
        self.stats.append(dict(stats))
        if run.step == self.stop_at:
            run.policies.request_stop("enough", 7)
            run.lr_scale = 0.5

    def state_dict(self):
        return {"n": len(self.stats)}

    def load_state_dict(self, state):
        self.stats = [{}] * state["n"]


def _feed(run, x, y, steps, micro):
    for t in range(steps):
        for i in range(run.k_steps):
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[t, i * micro:(i + 1) * micro]),
                                            y[t, i * micro:(i + 1) * micro]))


def test_prepare_takes_policy_objects_and_saves_their_state():
    x, y = make_data(4, 64)
    rec = Recorder(stop_at=3)
    run = prepare(make_model(), strategy("sgd", 64, 32, 2), total_steps=10, world=ONE,
                  policies=[rec])
    _feed(run, x, y, 4, 32)
    assert [s["step"] for s in rec.stats] == [1, 2, 3, 4]
    assert rec.stats[0]["global_batch_size"] == 64 and rec.stats[0]["k_steps"] == 2
    assert rec.stats[0]["step_seconds"] > 0
    assert run.policies.stop == ("enough", 7) and run.lr_scale == 0.5
    assert run.policies.get("recorder") is rec
    other = Recorder()
    again = prepare(make_model(), strategy("sgd", 64, 32, 2), total_steps=10, world=ONE,
                    policies=[other])
    again.load_state_dict(run.state_dict())
    assert len(other.stats) == 4


def test_prepare_refuses_what_is_not_a_policy():
    with pytest.raises(PolicyError, match="is not a bigbatch.Policy"):
        prepare(make_model(), strategy("sgd", 64), total_steps=2, world=ONE,
                policies=[NotAPolicy()])
    with pytest.raises(PolicyError, match="two policies are named 'recorder'"):
        prepare(make_model(), strategy("sgd", 64), total_steps=2, world=ONE,
                policies=[Recorder(), Recorder()])


def test_goodput_runs_as_a_policy():
    for adaptive in ({"batch_size": "goodput"}, {"policies": ["goodput"]}):
        run = prepare(make_model(), strategy("sgd", 64, 32, 2, adaptive=adaptive),
                      total_steps=10, world=ONE)
        assert [p.name for p in run.policies] == ["goodput"] and run.adaptive.tuner is not None


@pytest.mark.parametrize("adaptive,straggler,message", [
    ({"policies": ["goodput", "noise_scale_doubling"]}, {}, "both choose the global batch"),
    ({"policies": ["straggler", "straggler"]}, {}, "names 'straggler' twice"),
    ({"policies": ["straggler"], "noise_scale": True}, {"action": "rebalance"},
     "unequal micro batches"),
    ({"policies": ["straggler"]}, {"action": "retry"}, "straggler.action"),
    ({"policies": ["straggler"]}, {"threshold": 1.0}, "straggler.threshold"),
])
def test_policy_config_mistakes_are_one_line(adaptive, straggler, message):
    with pytest.raises(ConfigError, match=message):
        strategy("sgd", 64, adaptive=adaptive, straggler=straggler)


def test_straggler_is_refused_with_sharding():
    with pytest.raises(ConfigError, match="with \\[sharding\\].*plain data parallelism"):
        strategy("sgd", 64, adaptive={"policies": ["straggler"]}, sharding={"stage": 2})


def test_overview_shows_straggler_only_when_on():
    assert "straggler" not in strategy("sgd", 64).overview(1)
    text = strategy("sgd", 64, adaptive={"policies": ["straggler"]},
                    straggler={"action": "stop"}).overview(1)
    assert "[straggler]" in text and "stop" in text


# ---------------------------------------------------------------- noise_scale_doubling


def test_doubler_doubles_each_time_the_noise_scale_doubles_within_bounds():
    d = NoiseScaleDoubler(max_batch_size=256)
    assert d.decide(float("nan"), 64) is None and d.reference is None  # no signal yet
    assert d.decide(100.0, 64) is None and d.reference == 100.0         # the reference
    assert d.decide(199.0, 64) is None
    assert d.decide(200.0, 64) == 128 and d.reference == 200.0
    assert d.decide(390.0, 128) is None
    assert d.decide(400.0, 128) == 256
    assert d.decide(10_000.0, 256) is None                               # the bound
    again = NoiseScaleDoubler(256)
    again.load_state_dict(d.state_dict())
    assert again.reference == 400.0


def test_noise_scale_doubling_policy_grows_micro_then_merge_steps():
    s = strategy("sgd", 64, 32, 2, adaptive={"policies": ["noise_scale_doubling"],
                                             "interval_steps": 2, "max_batch_size": 256})
    run = prepare(make_model(), s, total_steps=100, world=ONE)
    assert [p.name for p in run.policies] == ["noise_scale_doubling"]
    noise = iter([50.0, 60.0, 100.0, 150.0, 200.0, 800.0, 2000.0])
    tracker = SimpleNamespace(b_simple=0.0)
    run.adaptive.tracker, run.adaptive.flush = tracker, lambda: None
    run.grad_hooks.clear()  # the noise scale is the test's
    x, y = make_data(14, 256)
    sizes = []
    for t in range(14):
        if t % 2 == 0:
            tracker.b_simple = next(noise)
        m = run.plan.micro_batch_size
        _feed(run, x[t:t + 1], y[t:t + 1], 1, m)
        sizes.append((run.plan.global_batch_size, m, run.k_steps))
    # Decisions at steps 2, 4, ...: reference 50; 100 doubles (step 6), 200 doubles (step 10);
    # the micro batch is the configured one (32), so the merge steps grow; 256 is the bound.
    assert [g for g, _, _ in sizes] == [64] * 5 + [128] * 4 + [256] * 5
    assert sizes[-1] == (256, 32, 8)
    assert [c["step"] for c in run.batch_size_changes] == [6, 10]
    assert run.progress == pytest.approx(6 + 4 * 2 + 4 * 4)
