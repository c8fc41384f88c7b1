"""Reading an LR range test's curve (`bigbatch.train.lr_suggest`) on synthetic curves: a
clean valley, the same with noise, a short sweep, one that diverges from the start, a
flat one, one that turns non-finite."""

import math
import random

import pytest

from bigbatch.train.lr_range import _ema
from bigbatch.train.lr_suggest import SAFETY, diverged, smooth, suggest


def sweep(n=40, lo=1e-4, hi=1e2):
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def valley(lrs, best=0.3):
    """Flat at 2.3 for tiny LRs, falling to about 0.5 near `best`, rising fast beyond."""
    out = []
    for lr in lrs:
        x = math.log10(lr / best)
        out.append(2.3 - 1.8 / (1 + math.exp(-4 * (x + 1))) + (3.0 * x * x if x > 0 else 0.0))
    return out


def argmin(xs):
    return min(range(len(xs)), key=xs.__getitem__)


def test_a_clean_valley_suggests_its_minimum_over_the_safety_factor():
    lrs = sweep()
    losses = valley(lrs)
    got = suggest(lrs, losses)
    true_min = lrs[argmin(losses)]
    assert got.lr == pytest.approx(got.minimum_lr / SAFETY)
    assert true_min / 2 <= got.minimum_lr <= true_min * 2
    assert "minimum" in got.reason


def test_noise_moves_the_suggestion_little():
    lrs = sweep()
    clean = suggest(lrs, valley(lrs)).lr
    rng = random.Random(0)
    for _ in range(5):
        noisy = [x + rng.gauss(0, 0.08) for x in valley(lrs)]
        got = suggest(lrs, noisy).lr
        assert clean / 3 <= got <= clean * 3


def test_the_smoothing_does_not_lag_on_a_short_sweep():
    """20 points: the centred average keeps the minimum where it is and about as deep;
    fastai's exponential average (0.98) is still near the mean of the whole sweep there."""
    lrs = sweep(20)
    losses = valley(lrs)
    s, ema = smooth(losses), _ema(losses, 0.98)
    assert abs(argmin(s) - argmin(losses)) <= 1
    assert min(s) - min(losses) < 0.2 < 0.5 < min(ema) - min(losses)
    assert smooth([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]  # a straight line stays straight


def test_a_curve_that_diverges_from_the_start_falls_back():
    lrs = sweep()
    losses = [2.3 * 1.15**i for i in range(len(lrs))]
    got = suggest(lrs, losses)
    assert got.lr is None and got.diverged_index is not None
    assert "rose from the first step" in got.reason


def test_a_flat_curve_falls_back():
    rng = random.Random(1)
    lrs = sweep()
    got = suggest(lrs, [2.3 + rng.gauss(0, 0.01) for _ in lrs])
    assert got.lr is None and "no clear descent" in got.reason


def test_a_curve_too_short_before_a_nan_falls_back():
    got = suggest(sweep(10), [2.3, 2.2, 2.0, math.nan] + [1.0] * 6)
    assert got.lr is None and got.diverged_index == 3 and "only 3 points" in got.reason


def test_divergence_is_a_nan_4x_the_best_or_back_above_the_start():
    assert diverged([2.0, 1.9, math.inf, 1.0]) == 2
    assert diverged([5.0, 0.5, 0.3, 0.2, 0.2, 0.2, 1.0, 1.0, 1.0]) == 8  # 4x the best
    # cross-entropy from 2.3 to 1.5 and back to chance: never 4x, but above the start
    up = [2.3, 2.2, 2.0, 1.8, 1.5, 1.5, 2.6, 2.9, 3.0]
    assert diverged(up) == 7
    assert diverged([2.3, 2.31, 2.29, 2.32, 2.3, 2.33]) is None  # noise at the start is not


def test_the_suggestion_stops_at_divergence():
    """A second, deeper dip after the loss diverged does not count."""
    lrs = sweep()
    losses = valley(lrs)
    later = argmin(losses) + 8
    losses[later:] = [0.01] * (len(losses) - later)
    got = suggest(lrs, losses)
    assert got.minimum_lr < lrs[later] and got.diverged_index is not None


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="3 LRs but 2 losses"):
        suggest([1, 2, 3], [1.0, 2.0])


def test_the_reason_says_where_the_minimum_is():
    lrs = sweep()
    losses = valley(lrs)
    m = argmin(losses)
    rising = losses[:m + 4] + [losses[m] + 0.1 * i for i in range(1, len(lrs) - m - 3)]
    assert "the loss rose after it, without diverging" in suggest(lrs, rising).reason
    falling = [2.3 - 0.04 * i for i in range(len(lrs))]
    assert "at the sweep's top" in suggest(lrs, falling).reason
    assert "before divergence" in suggest(lrs, losses).reason


def test_a_blow_up_past_the_minimum_is_not_noise():
    """SGD at 16384 on MNIST-1D, a 15-step sweep (seed 1): three points of descent, then
    the loss blows up until it is not finite. Counted as noise, the blow-up hid the
    descent (the run fell back to the scaled LR, 12.8, and reached 12.7%)."""
    lrs = [0.128, 0.2471, 0.4771, 0.9212, 1.7786, 3.4339, 6.6297, 12.8, 24.7]
    losses = [2.376, 2.21, 1.948, 2.029, 4.543, 11.156, 3.829, 7.485, math.nan]
    got = suggest(lrs, losses)
    assert got.minimum_lr == 0.4771 and got.lr == pytest.approx(0.4771 / SAFETY)
    noisy_flat = [2.3, 2.9, 2.1, 2.7, 2.2, 2.8, 2.25, 2.6, math.nan]  # no descent: still none
    assert suggest(lrs, noisy_flat).lr is None
