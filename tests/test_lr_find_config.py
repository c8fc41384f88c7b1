"""`[batch] lr_find` and the large-batch recipe keys beside it: validation, the warmup that
grows with the batch, the clock's found peak, label smoothing, the study option."""

import pytest
import torch
from torch import nn

from bigbatch.config.schedules import Schedule, grown_warmup
from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World


def batch(**keys):
    return Strategy.from_dict({"batch": {"global_batch_size": 2048, "base_batch_size": 256,
                                         "base_lr": 0.1, **keys}})


@pytest.mark.parametrize("keys, message", [
    ({"lr_find_range": [1.0, 0.1]}, "batch.lr_find_range must be two increasing multiples"),
    ({"lr_find_range": [0.1]}, "batch.lr_find_range must be two increasing multiples"),
    ({"lr_find_range": [0.0, 1.0]}, "batch.lr_find_range must be > 0"),
    ({"lr_find_steps": 2}, "batch.lr_find_steps must be in [5, 100000], got 2"),
    ({"lr_find_safety": 0.5}, "batch.lr_find_safety must be >= 1, got 0.5"),
    ({"lr_find": "yes"}, "batch.lr_find: expected bool, got str 'yes'"),
    ({"warmup_scaling": "log"}, "batch.warmup_scaling must be one of linear, sqrt, none"),
    ({"warmup_batch_size": 0}, "batch.warmup_batch_size must be >= 1, got 0"),
])
def test_bad_keys_are_refused_naming_the_key_and_range(keys, message):
    with pytest.raises(ConfigError) as info:
        batch(**keys)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_warmup_grows_with_the_batch_by_its_rule_and_at_most_half_the_run():
    assert grown_warmup(10, "none", 8192, 256, 1000) == 10
    assert grown_warmup(10, "sqrt", 8192, 2048, 1000) == 20
    assert grown_warmup(10, "linear", 8192, 2048, 1000) == 40
    assert grown_warmup(10, "linear", 8192, 2048, 50) == 25  # half the run
    assert grown_warmup(0, "sqrt", 8192, 256, 50) == 0
    s = batch(global_batch_size=8192, warmup_epochs=2, warmup_scaling="sqrt",
              warmup_batch_size=2048)
    sched = Schedule.from_strategy(s, s.resolve(1), total_steps=40, steps_per_epoch=4)
    assert sched.warmup_steps == 16  # 2 epochs of 4 steps at 2048, x sqrt(4)
    plain = Schedule.from_strategy(batch(global_batch_size=8192, warmup_epochs=2),
                                   s.resolve(1), total_steps=40, steps_per_epoch=4)
    assert plain.warmup_steps == 8


def test_the_clock_trains_at_the_found_peak_and_a_resume_restores_it():
    s = batch(warmup_steps=4, decay="cosine")
    run = prepare(nn.Linear(3, 2), s, total_steps=20, world=World())
    assert run.last_lr == pytest.approx(0.1)  # warmup starts at base_lr
    run.clock.set_peak_lr(3.0, s)
    assert run.schedule.peak_lr == pytest.approx(3.0) and run.last_lr == pytest.approx(0.1)
    assert run.lr_at(4) == pytest.approx(3.0) and run.lr_at(20) == pytest.approx(0.0)
    state = run.state_dict()
    assert state["peak_factor"] == pytest.approx(3.0 / 0.8)
    fresh = prepare(nn.Linear(3, 2), s, total_steps=20, world=World())
    fresh.load_state_dict(state)
    assert fresh.lr_at(4) == pytest.approx(3.0)
    state.pop("peak_factor")  # a checkpoint from before lr_find: the configured peak
    older = prepare(nn.Linear(3, 2), s, total_steps=20, world=World())
    older.load_state_dict(state)
    assert older.lr_at(4) == pytest.approx(0.8)


def test_a_batch_change_scales_the_found_peak_by_the_rule():
    s = batch(global_batch_size=512, micro_batch_size=256, base_batch_size=256,
              scaling="linear")
    s = Strategy.from_dict({**s.to_dict(), "gradient_merge": {"avg": True}})
    run = prepare(nn.Linear(3, 2), s, total_steps=20, world=World())
    run.clock.set_peak_lr(1.0, s)  # configured 0.2
    run.set_batch(256, 4)  # 1024: twice the batch
    assert run.schedule.peak_lr == pytest.approx(2.0)


def test_label_smoothing_changes_the_training_loss_only():
    from types import SimpleNamespace

    from bigbatch.tasks import get_task
    from bigbatch.tasks.mnist1d import MNIST1D

    def loss(smoothing, out):
        return MNIST1D.loss(SimpleNamespace(label_smoothing=smoothing), out, y)[0].item()

    out, y = torch.randn(8, 10), (None, torch.arange(8) % 10)
    assert loss(0.1, out.clone().requires_grad_()) != loss(0.0, out)  # training: smoothed
    with torch.no_grad():  # evaluation (`eval_sums`): the plain cross-entropy
        assert loss(0.1, out) == loss(0.0, out)
    with pytest.raises(ConfigError, match="label_smoothing"):
        get_task("mnist1d", num_samples=200, label_smoothing=1.0)


def test_the_study_option_turns_lr_find_on_in_every_cell():
    from bigbatch.study.config import StudyConfig
    from bigbatch.study.rules import cell_strategy
    from bigbatch.tasks.mnist1d import _RECIPES

    for flag in (False, True):
        c = StudyConfig(epochs=2, lr_find=flag)
        for name in ("sgd", "lars", "lamb"):
            assert cell_strategy(c, _RECIPES["cnn"], name, 1024).batch.lr_find is flag


def test_the_overview_shows_the_found_peak_and_the_grown_warmup():
    s = batch(lr_find=True, warmup_epochs=2, warmup_scaling="sqrt", warmup_batch_size=512)
    before = s.overview(1, steps_per_epoch=19, total_steps=190)
    assert "found by lr_find (scaled: 0.8)" in before
    assert "76 steps, sqrt-scaled from 2 epochs" in before  # 38 at 512, x sqrt(4)
    found = {"peak_lr": 12.5, "time_s": 16.0, "fallback": False, "curve_file": "lr_find.json"}
    assert "12.5 (lr_find, 16 s; scaled 0.8)" in s.overview(1, lr_find=found)
    assert "0.8 (lr_find fell back to it)" in s.overview(1, lr_find={**found, "fallback": True})


def test_a_fallback_is_one_warning_line_and_keeps_the_scaled_lr():
    from bigbatch.train.lr_phase import FoundLR

    found = FoundLR(peak_lr=0.8, scaled_lr=0.8, suggested_lr=None,
                    reason="the loss showed no clear descent (drop 0.01, noise 0.02)",
                    global_batch_size=2048, steps=30, time_s=3.0)
    line = found.line()
    assert line.startswith("warning: lr_find: the loss showed no clear descent")
    assert "training with the scaled LR 0.8" in line and "\n" not in line
    assert found.to_dict()["fallback"] and FoundLR.from_dict(found.to_dict()) == found


@pytest.mark.parametrize("toml, steps", [
    ("[lars]", 15), ("[optimizer]\ntype = 'momentum'", 15),
    ("[optimizer]\ntype = 'adamw'", 30), ("[lamb]\n[optimizer]\ntype = 'adamw'", 30),
    ("[lamb]\n[optimizer]\ntype = 'adamw'\n[batch]\nlr_find_steps = 12", 12),
])
def test_the_sweep_is_15_steps_for_momentum_and_30_for_adam_unless_set(toml, steps):
    s = Strategy.from_toml(toml)
    assert s.lr_find_steps == steps
    row = next(line for line in s.overview(1).splitlines() if "lr_find_steps" in line)
    assert f" {steps} " in row and ("unset" in row) is ("lr_find_steps" not in toml)
