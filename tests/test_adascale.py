"""AdaScale gain, AdamScale power, scale-invariant progress, state_dict."""

import io
import math

import pytest
import torch

from bigbatch.adaptive.adascale import AdaScale, gain
from bigbatch.adaptive.gns import GradientNoiseScale, NoiseEstimate
from bigbatch.errors import ConfigError


def _through_torch_save(state):
    """Checkpoints go through torch.save / torch.load(weights_only=True): plain types only."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    "var,sqr,scale,expected",
    [
        (1.0, 1.0, 1.0, 1.0),  # scale 1: always 1
        (1.0, 1.0, 2.0, 2.0 / 1.5),
        (1.0, 1.0, 4.0, 2.0 / 1.25),
        (3.0, 1.0, 4.0, 4.0 / 1.75),
        (1.0, 3.0, 8.0, 4.0 / 3.125),
        (10.0, 0.1, 16.0, 10.1 / 0.725),
        (0.0, 2.0, 8.0, 1.0),  # no noise: nothing to gain
        (2.0, 0.0, 8.0, 8.0),  # pure noise: linear scaling
        (0.0, 0.0, 8.0, 1.0),  # nothing known
        (-1.0, 2.0, 8.0, 1.0),  # negative estimates count as zero
        (2.0, -0.5, 8.0, 8.0),
        (math.nan, 1.0, 8.0, 1.0),
        (math.inf, 1.0, 8.0, 8.0),
        (1.0, math.inf, 8.0, 1.0),
        (1.0, 1.0, 0.5, 2.0 / 3.0),  # batch below base: gain in [S, 1]
    ],
)
def test_gain_table(var, sqr, scale, expected):
    assert gain(var, sqr, scale) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("scale", [1.0, 2.0, 7.0, 64.0, 0.25])
def test_gain_stays_in_range(scale):
    for var in (0.0, 1e-9, 0.3, 1.0, 5.0, 1e9):
        for sqr in (0.0, 1e-9, 0.3, 1.0, 5.0, 1e9):
            r = gain(var, sqr, scale)
            assert min(1.0, scale) - 1e-12 <= r <= max(1.0, scale) + 1e-12


def test_gain_rejects_bad_scale():
    with pytest.raises(ConfigError, match="scale"):
        gain(1.0, 1.0, 0.0)


def test_class_uses_scale1_variance():
    # tr(Sigma) = 64 per example, B0 = 16: the scale-1 gradient variance is 4.
    ada = AdaScale(16, 64)
    assert ada.scale == 4.0
    assert ada.gain(sq_norm=4.0, trace=64.0) == pytest.approx(gain(4.0, 4.0, 4.0))
    assert ada.gain(sq_norm=4.0, trace=64.0) == pytest.approx(8.0 / 5.0)


def test_gain_over_scale_is_pollux_efficiency():
    sq, trace, b0 = 0.5, 40.0, 32
    b_noise = trace / sq
    for b in (32, 64, 256, 4096):
        r = AdaScale(b0, b).gain(sq, trace)
        assert r / (b / b0) == pytest.approx((b_noise + b0) / (b_noise + b))


def test_progress_counts_gains():
    ada = AdaScale(32, 128)
    assert ada.progress == 0.0 and ada.last_gain == 1.0
    mults = [ada.update(1.0, 32.0) for _ in range(3)]  # var = 1, sqr = 1 -> r = 1.6
    assert mults == pytest.approx([1.6] * 3)
    assert ada.progress == pytest.approx(4.8) and ada.steps == 3
    ada.update(0.0, 32.0)  # pure noise: r = S
    assert ada.progress == pytest.approx(8.8)
    assert ada.update(math.nan, math.nan) == 1.0  # no estimate yet
    assert ada.progress == pytest.approx(9.8)


def test_scale_one_progress_is_step_count():
    ada = AdaScale(64, 64)
    for _ in range(10):
        ada.update(0.3, 100.0)
    assert ada.progress == pytest.approx(10.0)
    assert ada.done(10) and not ada.done(10.5)


def test_progress_depends_only_on_global_batch():
    """Merge steps and workers only matter through the global batch they make up."""
    runs = {}
    for micro, k, world in [(32, 4, 1), (16, 4, 2), (64, 1, 2), (8, 4, 4)]:
        ada = AdaScale(32, micro * k * world)
        tracker = GradientNoiseScale(beta=0.9)
        steps = 0
        while not ada.done(100):
            tracker.update_estimate(NoiseEstimate(sq_norm=1.0 / (1 + steps), trace=30.0))
            ada.update(tracker.sq_norm, tracker.trace)
            steps += 1
        runs[(micro, k, world)] = (steps, ada.progress)
    assert len(set(runs.values())) == 1
    steps, progress = runs[(32, 4, 1)]
    assert 100 <= progress < 100 + 4  # overshoots by less than one gain (<= S = 4)
    assert 25 < steps < 100  # faster than scale 1, no faster than linear scaling


def test_adamscale_power():
    ada = AdaScale(8, 32, power=0.5)
    mult = ada.update(0.0, 80.0)  # pure noise: r = 4
    assert ada.last_gain == 4.0 and mult == pytest.approx(2.0) and ada.lr_factor == mult
    assert ada.progress == 4.0


def test_batch_size_change_keeps_progress():
    ada = AdaScale(10, 20)
    ada.update(0.0, 1.0)
    ada.set_batch_size(80)
    assert ada.scale == 8.0
    ada.update(0.0, 1.0)
    assert ada.progress == pytest.approx(2.0 + 8.0)


def test_state_dict_round_trip():
    a = AdaScale(16, 128, power=0.5)
    for i in range(5):
        a.update(1.0 / (i + 1), 50.0)
    b = AdaScale(1, 1)
    b.load_state_dict(_through_torch_save(a.state_dict()))
    assert b.state_dict() == a.state_dict()
    for i in range(5):
        assert a.update(0.2 * i, 10.0) == b.update(0.2 * i, 10.0)
    assert a.progress == b.progress and a.steps == b.steps == 10


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"base_batch_size": 0, "global_batch_size": 8}, "base_batch_size"),
        ({"base_batch_size": 8, "global_batch_size": 0}, "global_batch_size"),
        ({"base_batch_size": 8, "global_batch_size": 8, "power": 0.0}, "power"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AdaScale(**kwargs)
