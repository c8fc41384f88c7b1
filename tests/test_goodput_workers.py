"""Pollux's worker count: `GoodputTuner.suggest(..., worlds=...)` picks n with the batch, on
step times drawn from a known throughput model."""

import itertools

import numpy as np
import pytest

from bigbatch.adaptive.goodput import GoodputTuner, ThroughputParams, goodput, step_time


def _tuner(true: ThroughputParams, worlds=(1, 2, 4), threshold=0.05,
           max_batch=1024) -> GoodputTuner:
    t = GoodputTuner(64, min_batch_size=16, max_batch_size=max_batch, max_micro_batch_size=128,
                     threshold=threshold, micro_batch_sizes=(16, 32, 64, 128))
    for m, k, n in itertools.product((16, 64), (1, 2), worlds):
        for _ in range(3):
            t.record(m, k, n, step_time(true, m, k, n))
    return t


def _brute(true, noise, worlds):
    best = None
    for m in (16, 32, 64, 128):
        for n in worlds:
            for k in range(1, 1025):
                if not 16 <= m * k * n <= 1024:
                    continue
                g = goodput(true, m, k, n, noise, 64)
                if best is None or g > best[0] * (1 + 1e-9):
                    best = (g, m, k, n)
    return best


@pytest.mark.parametrize("alpha_n,beta_n,noise,want_n", [
    (1e-4, 1e-4, 2000.0, 4),  # cheap sync, large noise scale: every worker helps
    (0.5, 0.5, 2000.0, 1),    # a sync costing 100 steps of compute: stay alone
    (0.01, 0.1, 2000.0, 2),   # a cheap pair, an expensive third worker
])
def test_picks_the_worker_count_of_the_best_goodput(alpha_n, beta_n, noise, want_n):
    true = ThroughputParams(alpha_c=0.002, beta_c=1e-4, alpha_n=alpha_n, beta_n=beta_n)
    tuner = _tuner(true)
    s = tuner.suggest(16, 1, 1, noise, worlds=(1, 2, 3, 4))
    g, m, k, n = _brute(true, noise, (1, 2, 3, 4))
    assert s.world_size == want_n == n, s.reason
    assert (s.micro_batch_size, s.k_steps) == (m, k), s.reason
    assert s.goodput == pytest.approx(g, rel=1e-3)
    assert f"x {n} workers" in s.reason


def test_without_worlds_the_worker_count_stays():
    true = ThroughputParams(alpha_c=0.002, beta_c=1e-4, alpha_n=1e-4, beta_n=1e-4)
    s = _tuner(true).suggest(16, 1, 2, 2000.0)
    assert s.world_size == 2


def test_a_gain_within_the_threshold_keeps_the_size():
    # Sync that eats almost all of a second worker's gain (the batch cannot grow to hide
    # it): +1% goodput, threshold 5%.
    true = ThroughputParams(alpha_c=0.0, beta_c=1e-3, alpha_n=0.98 * 0.128, beta_n=10.0)
    tuner = _tuner(true, worlds=(1, 2), threshold=0.05, max_batch=256)
    s = tuner.suggest(128, 1, 1, np.inf, worlds=(1, 2))
    assert s.world_size == 1 and not s.changed, s.reason
    assert "within threshold" in s.reason
