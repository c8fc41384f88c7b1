"""Gradient noise scale: estimators on a problem with a closed-form answer, tracker, DDP path.

Linear regression ``y = x . w* + e`` with ``x ~ N(0, I_d)``, ``e ~ N(0, s^2)`` and loss
``0.5 (x . w - y)^2``. With ``u = w - w*`` the per-example gradient is
``g = x (x . u) - x e``, so ``G = E[g] = E[x x^T] u = u`` and, by Isserlis' theorem,
``E[x_i x_j (x . u)^2] = delta_ij |u|^2 + 2 u_i u_j``; with ``E[x x^T e^2] = s^2 I`` and a
vanishing cross term, ``E[g g^T] = (|u|^2 + s^2) I + 2 u u^T``, hence

    Sigma     = (|u|^2 + s^2) I + u u^T
    tr(Sigma) = d (|u|^2 + s^2) + |u|^2,      |G|^2 = |u|^2.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.distributed as dist

from bigbatch import gns
from bigbatch.adaptive.gns import (
    ConsecutiveSteps,
    GradientNoiseScale,
    NoiseEstimate,
    adam_sq_norm,
    estimate,
    merge_sq_norms,
    sq_norm,
)
from bigbatch.errors import ConfigError

D, NOISE = 6, 0.7


def _problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=gen, dtype=torch.float64) * 0.5
    g2 = float(u @ u)
    trace = D * (g2 + NOISE**2) + g2
    return u, g2, trace


def _per_example_grads(u: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator):
    x = torch.randn(*shape, D, generator=gen, dtype=torch.float64)
    e = torch.randn(*shape, generator=gen, dtype=torch.float64) * NOISE
    return x * ((x @ u) - e).unsqueeze(-1)


def _draws(u, reps, workers, local, seed):
    """``reps`` independent DDP-like steps: small = mean over workers of |local mean|^2."""
    gen = torch.Generator().manual_seed(seed)
    g = _per_example_grads(u, (reps, workers, local), gen)
    local_mean = g.mean(dim=2)
    small = local_mean.square().sum(-1).mean(-1)
    big = local_mean.mean(dim=1).square().sum(-1)
    return small, big


def _mean_and_se(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(len(values)))


def _through_torch_save(state):
    """Checkpoints go through torch.save / torch.load(weights_only=True): plain types only."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_closed_form_matches_monte_carlo_covariance():
    u, _, trace = _problem()
    gen = torch.Generator().manual_seed(1)
    g = _per_example_grads(u, (200_000,), gen)
    cov = torch.cov(g.T)
    expected = (float(u @ u) + NOISE**2) * torch.eye(D, dtype=torch.float64) + torch.outer(u, u)
    assert torch.allclose(g.mean(0), u, atol=0.02)
    assert torch.allclose(cov, expected, atol=0.15)
    assert float(cov.trace()) == pytest.approx(trace, rel=0.02)


@pytest.mark.parametrize("workers,local", [(2, 1), (8, 4), (4, 16)])
def test_estimates_are_unbiased(workers, local):
    u, g2, trace = _problem()
    small, big = _draws(u, 4000, workers, local, seed=workers * 100 + local)
    ests = [estimate(s, b, local, local * workers) for s, b in zip(small, big, strict=True)]
    g2_mean, g2_se = _mean_and_se([e.sq_norm for e in ests])
    tr_mean, tr_se = _mean_and_se([e.trace for e in ests])
    assert abs(g2_mean - g2) < 4 * g2_se
    assert abs(tr_mean - trace) < 4 * tr_se
    # The test has power: the naive big-batch norm is biased by tr(Sigma)/B by many errors.
    big_mean, big_se = _mean_and_se(big.tolist())
    assert abs(big_mean - g2) > 4 * big_se


def test_estimate_formula_by_hand():
    # |G|^2 = 1, tr = 8 at B=2 and B=8: E|G_2|^2 = 5, E|G_8|^2 = 2.
    est = estimate(5.0, 2.0, 2, 8)
    assert est.sq_norm == pytest.approx(1.0)
    assert est.trace == pytest.approx(8.0)
    assert est.b_simple == pytest.approx(8.0)
    assert estimate(torch.tensor(5.0), torch.tensor(2.0), 2, 8) == est


@pytest.mark.parametrize("small,big", [(0, 4), (4, 4), (8, 4), (-1, 2)])
def test_estimate_rejects_bad_batches(small, big):
    with pytest.raises(ConfigError, match="small_batch"):
        estimate(1.0, 1.0, small, big)


def test_b_simple_edge_cases():
    assert NoiseEstimate(-1.0, 3.0).b_simple == math.inf
    assert math.isnan(NoiseEstimate(-1.0, -3.0).b_simple)
    assert NoiseEstimate(2.0, -3.0).b_simple == 0.0
    tracker = GradientNoiseScale()
    assert math.isnan(tracker.b_simple) and math.isnan(tracker.sq_norm)
    assert math.isnan(tracker.b_simple_stderr)


def test_tracker_bias_correction_exact_on_constant_input():
    tracker = GradientNoiseScale(beta=0.9)
    for step in range(1, 30):
        tracker.update_estimate(NoiseEstimate(3.0, 7.5))
        assert tracker.steps == step
        assert tracker.sq_norm == pytest.approx(3.0, rel=1e-12)
        assert tracker.trace == pytest.approx(7.5, rel=1e-12)
        assert tracker.b_simple == pytest.approx(2.5, rel=1e-12)


def test_tracker_is_ratio_of_emas_not_ema_of_ratios():
    tracker = GradientNoiseScale(beta=0.5)
    tracker.update_estimate(NoiseEstimate(1.0, 1.0))
    tracker.update_estimate(NoiseEstimate(3.0, 1.0))
    # EMAs with correction 1 - 0.25: sq = (0.25 + 1.5) / 0.75, trace = (0.25 + 0.5) / 0.75.
    assert tracker.sq_norm == pytest.approx(1.75 / 0.75)
    assert tracker.trace == pytest.approx(1.0)
    assert tracker.b_simple == pytest.approx(0.75 / 1.75)


def test_tracker_skips_non_finite():
    tracker = GradientNoiseScale()
    tracker.update_estimate(NoiseEstimate(math.nan, 1.0))
    tracker.update_estimate(NoiseEstimate(1.0, math.inf))
    assert tracker.steps == 0


def test_tracker_converges_and_stderr_is_calibrated():
    u, g2, trace = _problem()
    truth = trace / g2
    workers, local, steps, runs = 4, 8, 150, 120
    small, big = _draws(u, steps * runs, workers, local, seed=7)
    finals, stderrs = [], []
    for r in range(runs):
        tracker = GradientNoiseScale(beta=0.95, window=150)
        for i in range(r * steps, (r + 1) * steps):
            tracker.update(small[i], big[i], local, local * workers)
        finals.append(tracker.b_simple)
        stderrs.append(tracker.b_simple_stderr)
    mean, _ = _mean_and_se(finals)
    spread = float(torch.tensor(finals).std())
    typical_se = float(torch.tensor(stderrs).median())
    assert mean == pytest.approx(truth, rel=0.1)
    # The reported error describes the run-to-run spread (within a generous factor).
    assert 0.6 < typical_se / spread < 1.6


def test_tracker_state_dict_round_trip():
    u, _, _ = _problem()
    small, big = _draws(u, 40, 2, 4, seed=3)
    a = GradientNoiseScale(beta=0.8, biased=True, window=10)
    for i in range(20):
        a.update(small[i], big[i], 4, 8)
    b = GradientNoiseScale()
    b.load_state_dict(_through_torch_save(a.state_dict()))
    assert b.biased and b.steps == 20 and b.window == 10
    for i in range(20, 40):
        a.update(small[i], big[i], 4, 8)
        b.update(small[i], big[i], 4, 8)
    assert (a.sq_norm, a.trace, a.b_simple, a.b_simple_stderr) == (
        b.sq_norm,
        b.trace,
        b.b_simple,
        b.b_simple_stderr,
    )
    assert a.state_dict() == b.state_dict()


def test_tracker_rejects_bad_beta():
    with pytest.raises(ConfigError, match="gns_ema"):
        GradientNoiseScale(beta=1.0)


def test_sq_norm_helper():
    ts = [torch.randn(3, 4), None, torch.randn(5).half(), torch.randn(2, dtype=torch.float64)]
    expected = sum(float(t.double().square().sum()) for t in ts if t is not None)
    out = sq_norm(ts)
    assert out.dtype == torch.float64 and out.dim() == 0
    assert sq_norm(ts[:3]).dtype == torch.float32
    assert float(out) == pytest.approx(expected, rel=1e-3)
    assert float(sq_norm([])) == 0.0
    big = [torch.full((4,), 1000.0, dtype=torch.float16)]
    assert float(sq_norm(big)) == pytest.approx(4e6)  # no fp16 overflow


def test_adam_sq_norm_matches_manual():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-3)
    params = list(model.parameters())
    x = torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    grads = [p.grad for p in params]
    expected = 0.0
    for p in params:
        st = opt.state[p]
        v_hat = st["exp_avg_sq"] / (1 - 0.99 ** float(st["step"]))
        expected += float((p.grad / (v_hat.sqrt() + 1e-3)).square().sum())
    assert float(adam_sq_norm(opt, params, grads)) == pytest.approx(expected, rel=1e-5)
    fresh = torch.optim.Adam(params)
    assert float(adam_sq_norm(fresh, params, grads)) == pytest.approx(float(sq_norm(grads)))


def test_adam_sq_norm_reads_lamb_state_and_bias_correction_flag():
    from bigbatch.optim import LAMB

    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    opt = LAMB(params, lr=1e-2, betas=(0.8, 0.9), eps=1e-4)
    x = torch.randn(8, 3)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    grads = [p.grad for p in params]

    def manual(correct: bool) -> float:
        total = 0.0
        for p in params:
            v = opt.state[p]["exp_avg_sq"]
            if correct:
                v = v / (1 - 0.9 ** float(opt.state[p]["step"]))
            total += float((p.grad / (v.sqrt() + 1e-4)).square().sum())
        return total

    assert float(adam_sq_norm(opt, params, grads)) == pytest.approx(manual(True), rel=1e-5)
    opt.param_groups[0]["bias_correction"] = False
    assert float(adam_sq_norm(opt, params, grads)) == pytest.approx(manual(False), rel=1e-5)


def test_consecutive_steps_pairs():
    pairer = ConsecutiveSteps()
    g1 = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    g2 = [torch.tensor([3.0, 0.0]), torch.tensor([-1.0])]
    assert pairer(g1, batch=4) is None
    g1[0].zero_()  # the pairer keeps its own copy
    pair = pairer(g2, batch=4)
    assert pair.small_batch == 4 and pair.big_batch == 8
    assert pair.small_sq_norm == pytest.approx((14 + 10) / 2)
    assert pair.big_sq_norm == pytest.approx((4 + 1 + 1) / 1)
    assert pairer(g1, batch=4).small_sq_norm == pytest.approx((10 + 9) / 2)
    pairer.reset()
    assert pairer(g1, batch=4) is None


def test_consecutive_steps_unbiased_when_parameters_stay():
    u, g2, trace = _problem()
    gen = torch.Generator().manual_seed(11)
    steps = _per_example_grads(u, (3001, 4), gen).mean(1)
    pairer, ests = ConsecutiveSteps(), []
    for g in steps:
        pair = pairer([g], batch=4)
        if pair is not None:
            ests.append(estimate(*pair))
    # Overlapping pairs are correlated; use non-overlapping ones for the error bar.
    g2_mean, g2_se = _mean_and_se([e.sq_norm for e in ests[::2]])
    tr_mean, tr_se = _mean_and_se([e.trace for e in ests[::2]])
    assert abs(g2_mean - g2) < 4 * g2_se
    assert abs(tr_mean - trace) < 4 * tr_se


def test_merge_sq_norms():
    assert merge_sq_norms(torch.tensor(2.0), 1.0, 8, 4) == (2.0, 1.0, 8, 32)


def test_ddp_sq_norms_single_process_is_none():
    assert gns.ddp_sq_norms(1.0, 1.0, 8) is None


# ----------------------------------------------------------------------------- 2 processes


def _ddp_worker() -> None:
    """One rank of a 2-process gloo group (made by `run_workers`); raises on a mismatch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    xs = [torch.randn(6, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ref = copy.deepcopy(model)  # per-rank gradients, computed outside DDP's hooks

    def local_grads(r):
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        ref(xs[r]).pow(2).mean().backward()
        return [p.grad.clone() for p in ref.parameters()]

    opt = torch.optim.Adam(model.parameters(), eps=1e-4)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-5)
    state = gns.LocalSqNorm()
    ddp.register_comm_hook(state, gns.local_sq_norm_hook)
    for step in range(2):
        per_rank = [local_grads(r) for r in range(world)]
        opt.zero_grad()
        ddp(xs[rank]).pow(2).mean().backward()
        params = list(model.parameters())
        mean = [sum(g[i] for g in per_rank) / world for i in range(len(params))]
        for p, m in zip(params, mean, strict=True):
            torch.testing.assert_close(p.grad, m)  # hook reduces like DDP's default
        local = state.pop()
        assert state.pop() is None
        pair = gns.ddp_sq_norms(local, sq_norm(p.grad for p in params), 6)
        if step == 0:
            small = sum(float(sq_norm(g)) for g in per_rank) / world
            assert pair.small_sq_norm == pytest.approx(small, rel=1e-5)
            assert pair.big_sq_norm == pytest.approx(float(sq_norm(mean)), rel=1e-5)
            assert (pair.small_batch, pair.big_batch) == (6, 6 * world)
            opt.step()
            state.optimizer = opt  # second step: preconditioned norms
        else:
            small = sum(float(adam_sq_norm(opt, params, g)) for g in per_rank) / world
            assert pair.small_sq_norm == pytest.approx(small, rel=1e-5)


def test_ddp_local_vs_global_two_processes():
    from tests._dist import run_workers

    # The worker leaves the group to run_workers, which destroys it once the worker's DDP is
    # gone: the old worker destroyed it first, so DDP's reducer freed the gloo group later and
    # sometimes deadlocked on the GIL after all its work was done (see tests/_dist.py).
    run_workers(_ddp_worker, 2, timeout=120, init_group=True)
