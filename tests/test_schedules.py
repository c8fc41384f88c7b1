import math
from types import SimpleNamespace

import pytest
import torch

from bigbatch.config.schedules import (
    Schedule,
    lr_factor,
    scaled_warmup,
    warmup_start_lr,
    warmup_steps_of,
)
from bigbatch.config.strategy import Strategy
from bigbatch.errors import ConfigError


def values(schedule, n):
    return [schedule.lr(t) for t in range(n)]


def test_warmup_from_base_then_constant():
    s = Schedule(peak_lr=1.0, total_steps=6, warmup_steps=4, warmup_start_lr=0.2, decay="none")
    assert values(s, 8) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0])
    assert s.lr(0) == 0.2  # exactly the base LR, not peak * (base / peak)


def test_warmup_from_zero_then_linear_poly():
    s = Schedule(peak_lr=1.0, total_steps=6, warmup_steps=2, decay="poly", decay_power=1.0)
    assert values(s, 8) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_poly_power_and_final_ratio():
    s = Schedule(peak_lr=2.0, total_steps=4, decay="poly", decay_power=2.0, final_lr_ratio=0.2)
    # lr = 2 * (0.2 + 0.8 * (1 - t/4)^2)
    assert values(s, 6) == pytest.approx([2.0, 1.3, 0.8, 0.5, 0.4, 0.4])


def test_cosine_every_step():
    s = Schedule(peak_lr=1.0, total_steps=6, warmup_steps=2, warmup_start_lr=0.5, decay="cosine")
    c = (1 + math.cos(math.pi / 4)) / 2
    assert values(s, 8) == pytest.approx([0.5, 0.75, 1.0, c, 0.5, 1 - c, 0.0, 0.0], abs=1e-15)


def test_cosine_final_ratio_closed_form():
    s = Schedule(peak_lr=3.0, total_steps=100, warmup_steps=10, decay="cosine", final_lr_ratio=0.1)
    for t in range(10, 101):
        p = (t - 10) / 90
        expected = 3.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        assert s.lr(t) == pytest.approx(expected, rel=1e-12)
    assert s.lr(100) == pytest.approx(0.3)
    assert s.lr(10_000) == pytest.approx(0.3)


def test_step_decay_every_step():
    s = Schedule(
        peak_lr=1.0, total_steps=8, decay="step", decay_milestones=(0.5, 0.75), decay_gamma=0.1
    )
    assert values(s, 9) == pytest.approx([1, 1, 1, 1, 0.1, 0.1, 0.01, 0.01, 0.01])


def test_step_decay_goyal_epochs():
    # Goyal et al.: /10 at epochs 30, 60, 80 of 90 (one step per epoch here).
    s = Schedule(peak_lr=1.0, total_steps=90, decay="step", decay_milestones=(1 / 3, 2 / 3, 8 / 9))
    drops = [t for t in range(1, 91) if s.lr(t) < s.lr(t - 1)]
    assert drops == [30, 60, 80]
    assert s.lr(89) == pytest.approx(1e-3)


def test_step_decay_milestones_count_warmup():
    # Milestones are fractions of all training steps, warmup included.
    s = Schedule(peak_lr=1.0, total_steps=10, warmup_steps=2, decay="step", decay_milestones=(0.5,))
    assert values(s, 7) == pytest.approx([0, 0.5, 1, 1, 1, 0.1, 0.1])


def test_no_warmup_no_decay_is_constant():
    s = Schedule(peak_lr=0.4, total_steps=3)
    assert values(s, 5) == [0.4] * 5


def test_warmup_equal_to_total():
    s = Schedule(peak_lr=1.0, total_steps=2, warmup_steps=2, decay="cosine", final_lr_ratio=0.5)
    assert values(s, 4) == pytest.approx([0.0, 0.5, 0.5, 0.5])


def test_float_steps_are_allowed():
    s = Schedule(peak_lr=1.0, total_steps=10, warmup_steps=4, decay="none")
    assert s.lr(1.5) == pytest.approx(0.375)


def test_factor_and_call():
    s = Schedule(peak_lr=2.0, total_steps=10, warmup_steps=5, warmup_start_lr=0.5, decay="cosine")
    for t in range(12):
        assert s(t) == s.lr(t)
        assert s.factor(t) * 2.0 == pytest.approx(s.lr(t), rel=1e-15)
    assert lr_factor(7, total_steps=10, warmup_steps=5, decay="cosine") == s.factor(7)


def test_lambda_lr_and_apply_agree():
    s = Schedule(peak_lr=0.8, total_steps=12, warmup_steps=3, warmup_start_lr=0.1, decay="cosine")
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=s.peak_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, s.factor)
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=123.0)
    for t in range(14):
        assert opt.param_groups[0]["lr"] == pytest.approx(s.lr(t), rel=1e-12)
        assert s.apply(opt2, t) == s.lr(t) == opt2.param_groups[0]["lr"]
        opt.step()
        sched.step()


def test_bad_schedules():
    with pytest.raises(ConfigError, match="total_steps must be >= 1, got 0"):
        Schedule(peak_lr=1.0, total_steps=0)
    with pytest.raises(ConfigError, match="warmup of 11 steps does not fit in total_steps=10"):
        Schedule(peak_lr=1.0, total_steps=10, warmup_steps=11)
    with pytest.raises(
        ConfigError, match="decay must be one of cosine, poly, step, none; got 'exp'"
    ):
        Schedule(peak_lr=1.0, total_steps=10, decay="exp")
    with pytest.raises(ValueError, match="step must be >= 0"):
        Schedule(peak_lr=1.0, total_steps=10).lr(-1)


def test_warmup_start_rule():
    assert warmup_start_lr(0.1, 3.2) == 0.1  # gradual warmup from the base LR (Goyal et al.)
    assert warmup_start_lr(0.1, 0.1) == 0.0  # nothing to ramp: ramp from 0
    assert warmup_start_lr(0.1, 0.05) == 0.0


def test_warmup_epochs_conversion():
    assert warmup_steps_of(0, 2.5, 4) == 10
    assert warmup_steps_of(0, 5, 312) == 1560
    assert warmup_steps_of(7, 0.0, None) == 7
    with pytest.raises(ConfigError, match=r"batch.warmup_epochs=2.5 needs the optimizer steps "
                       r"per epoch: pass prepare\(..., samples_per_epoch=len\(train_set\)\)"):
        warmup_steps_of(0, 2.5, None)
    with pytest.raises(ConfigError, match="batch.warmup_steps=3 and batch.warmup_epochs=1"):
        warmup_steps_of(3, 1, 10)


def test_default_warmup_keeps_its_share_of_a_shorter_run():
    assert scaled_warmup(18, 20, 144) == 2  # mnist1d's demo: 2 of 16 epochs
    assert scaled_warmup(51, 20, 204) == 5  # charlm's demo: 1 of 4 epochs
    assert scaled_warmup(18, 1, 144) == 1  # never below one step, never past the run
    assert scaled_warmup(18, 144, 144) == 18 and scaled_warmup(18, 300, 144) == 18
    assert scaled_warmup(0, 5, 144) == 0


def test_from_strategy_linear_scaling_with_warmup_epochs():
    s = Strategy.from_toml(
        """
        [batch]
        global_batch_size = 1024
        base_batch_size = 256
        base_lr = 0.1
        warmup_epochs = 2
        decay = "step"
        decay_milestones = [0.5]
        decay_gamma = 0.5
        """
    )
    plan = s.resolve(2)
    sched = Schedule.from_strategy(s, plan, total_steps=20, steps_per_epoch=3)
    assert (sched.peak_lr, sched.warmup_steps, sched.warmup_start_lr) == (0.4, 6, 0.1)
    expected = [0.1 + 0.3 * t / 6 for t in range(6)] + [0.4] * 4 + [0.2] * 10
    assert values(sched, 20) == pytest.approx(expected)


def test_from_strategy_without_scale_ramps_from_zero():
    s = Strategy().with_overrides(["batch.warmup_steps=4", "batch.decay=none"])
    plan = s.resolve(1)
    assert plan.scale == 1.0
    sched = Schedule.from_strategy(s, plan, total_steps=8)
    assert values(sched, 6) == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1])


def test_from_strategy_duck_typed():
    batch = SimpleNamespace(
        base_lr=0.1,
        warmup_steps=0,
        warmup_epochs=0.0,
        decay="poly",
        decay_power=1.0,
        decay_milestones=[],
        decay_gamma=0.1,
        final_lr_ratio=0.0,
    )
    sched = Schedule.from_strategy(SimpleNamespace(batch=batch), SimpleNamespace(peak_lr=1.0), 4)
    assert values(sched, 5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_warmup_from_zero_is_nanogpts_line_and_base_stays_the_default():
    from bigbatch.config.schedules import Schedule
    from bigbatch.config.strategy import Strategy

    def lrs(**batch):
        s = Strategy.from_dict({"batch": {"global_batch_size": 1024, "base_batch_size": 256,
                                          "base_lr": 0.1, "warmup_steps": 4, **batch}})
        sched = Schedule.from_strategy(s, s.resolve(1), total_steps=100)
        return [sched.lr(t) for t in range(5)]

    assert lrs(warmup_start="zero") == pytest.approx([0.4 * (t + 1) / 5 for t in range(5)])
    assert lrs() == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4])  # Goyal: from base_lr
    with pytest.raises(ConfigError, match="warmup_start"):
        lrs(warmup_start="one")
