"""`[adaptive]` on 2 gloo workers: noise scale from local vs all-reduced norms, AdaScale,
goodput decisions agreed by all workers, exact resume.

Everything runs in one spawn of two processes (a module fixture); the checks
compare against gradients recomputed here in the test process.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from test_adaptive_engine import (
    Regression,
    assert_stats_match,
    grads_at,
    precondition,
    regression_data,
    snapshot_hook,
    sq,
)
from test_engine import make_data, make_model, params_of, strategy

from bigbatch.adaptive.adascale import gain as adascale_gain
from bigbatch.adaptive.gns import GradientNoiseScale
from bigbatch.adaptive.goodput import ThroughputParams, step_time
from bigbatch.engine.prepare import prepare

W, STEPS = 2, 4
GNS_CASES = (("sgd", 64, 2), ("adamw", 128, None))  # (optimizer, micro, k_steps)


def _feed(run, x, y, rank, steps=None, loss=F.cross_entropy):
    """Per step, the next `global` rows; worker r takes its `micro` rows of each W*micro."""
    for t in range(x.shape[0] if steps is None else steps):
        m, g = run.plan.micro_batch_size, run.plan.global_batch_size
        for j in range(0, g, W * m):
            rows = slice(j + rank * m, j + (rank + 1) * m)
            with run.micro_step() as ms:
                ms.backward(loss(run.model(x[t, rows]), y[t, rows]))
        assert ms.stepped


def _worker() -> dict:
    rank = int(os.environ["RANK"])
    out: dict = {}
    x, y = make_data(steps=STEPS)
    for opt, micro, k in GNS_CASES:
        run = prepare(make_model(), strategy(opt, micro=micro, k=k, adaptive={
            "noise_scale": True, "gns_warmup_steps": 0}),
                      total_steps=STEPS)
        snaps: list = []
        snapshot_hook(run, snaps)
        _feed(run, x, y, rank)
        out[opt] = (run.stats, snaps)

    s = strategy("sgd", micro=64, k=2, batch={"scaling": "none", "warmup_steps": 2},
                 adaptive={"lr": "adascale"})
    run = prepare(make_model(), s, total_steps=30)
    lrs, seen = [], []
    ada = run.adaptive.adascale
    run.optimizer.register_step_pre_hook(lambda o, a, kw: lrs.append(o.param_groups[0]["lr"]))
    run.grad_hooks.append(lambda info: seen.append(
        (run.progress, ada.last_gain, run.adaptive.tracker.sq_norm, run.adaptive.tracker.trace)))
    _feed(run, x, y, rank)
    out["adascale"] = (lrs, seen, [run.schedule.lr(b) for b, *_ in seen], run.progress,
                       ada.progress, ada.scale)

    # exact resume on 2 workers, AdaScale + noise scale state included
    s = strategy("sgd", micro=128, batch={"scaling": "none"}, adaptive={"lr": "adascale"})
    full = prepare(make_model(), s, total_steps=30)
    _feed(full, x, y, rank)
    first = prepare(make_model(), s, total_steps=30)
    _feed(first, x, y, rank, steps=2)
    state = copy.deepcopy(first.state_dict())
    model = make_model()
    model.load_state_dict(first.module.state_dict())
    resumed = prepare(model, s, total_steps=30)
    resumed.load_state_dict(state)
    _feed(resumed, x[2:], y[2:], rank)
    out["resume"] = (params_of(resumed.module), params_of(full.module), resumed.stats, full.stats)

    # goodput: the workers' step times disagree (rank 1 sees a slow network that favours
    # merging); every worker still applies rank 0's decision.
    times = ThroughputParams(0.01, 0.001, alpha_n=0.001 if rank == 0 else 10.0)
    s = strategy("sgd", global_batch=64, micro=16, k=2,
                 adaptive={"batch_size": "goodput", "min_batch_size": 32, "interval_steps": 3})
    run = prepare(Regression(), s, total_steps=40)
    ctl = run.adaptive
    ctl.measure_step_time = False
    run.step_hooks.insert(0, lambda r: ctl.tuner.record(
        r.plan.micro_batch_size, r.k_steps, W, step_time(times, r.plan.micro_batch_size,
                                                         r.k_steps, W)))
    rx, ry = regression_data(5, 64)
    _feed(run, rx, ry, rank, loss=F.mse_loss)
    own = ctl.tuner.suggest(16, 2, W, ctl.tracker.b_simple)  # what this worker alone would do
    out["goodput"] = (run.batch_size_changes, run.plan, own.global_batch_size)
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, world_size=W, timeout=120)


def _local_rows(micro: int, k: int | None, rank: int) -> torch.Tensor:
    return torch.cat([torch.arange(j + rank * micro, j + (rank + 1) * micro)
                      for j in range(0, 256, W * micro)])


@pytest.mark.parametrize("opt,micro,k", GNS_CASES)
def test_noise_scale_from_local_and_global_norms(results, opt, micro, k):
    x, y = make_data(steps=STEPS)
    stats, snaps = results[0][opt]
    assert results[1][opt][0] == stats  # same scalars on every worker
    expected = GradientNoiseScale(0.95)
    for t, (params, moments) in enumerate(snaps):
        if opt == "adamw" and moments[0] is None:
            continue
        local = []
        for r in range(W):
            rows = _local_rows(micro, k, r)
            local.append(sq(precondition(grads_at(params, x[t, rows], y[t, rows]), moments)))
        big = sq(precondition(grads_at(params, x[t], y[t]), moments))
        expected.update(sum(local) / W, big, 128, 256)

    class Stub:
        pass

    run = Stub()
    run.stats = stats
    assert_stats_match(run, expected)


def test_adascale_progress_on_two_workers(results):
    lrs, seen, sched, progress, ada_progress, scale = results[0]["adascale"]
    assert scale == 4.0 and len(lrs) == len(seen) == STEPS
    gains = [g for _, g, _, _ in seen]
    for lr, (_, g, sqn, tr), base in zip(lrs, seen, sched, strict=True):
        assert g == pytest.approx(adascale_gain(tr / 64, sqn, scale), rel=1e-12)
        assert lr == pytest.approx(base * g, rel=1e-12)
    assert [b for b, *_ in seen] == pytest.approx([sum(gains[:i]) for i in range(STEPS)])
    assert progress == pytest.approx(sum(gains)) == ada_progress and max(gains) > 1.05
    assert results[1]["adascale"][1] == seen


def test_resume_on_two_workers_is_exact(results):
    for r in range(W):
        resumed, full, resumed_stats, full_stats = results[r]["resume"]
        for a, b in zip(resumed, full, strict=True):
            assert torch.equal(a, b)
        assert resumed_stats == full_stats and "gns" in full_stats


def test_goodput_decision_is_rank_zeros_on_every_worker(results):
    changes0, plan0, own0 = results[0]["goodput"]
    changes1, plan1, own1 = results[1]["goodput"]
    assert changes0 == changes1 and plan0 == plan1
    assert [c["new"] for c in changes0] == [32] and plan0.k_steps == 1 and plan0.micro_batch_size == 16
    assert own0 == 32 and own1 > 32  # alone, rank 1 would have grown the batch


@pytest.mark.slow
def test_gns_command_relaunches_two_workers(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "gns.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "bigbatch.cli.gns", "--nproc", "2", "--task-opt",
         "num_samples=800", "--task-opt", f"cache_dir='{tmp_path}'", "--steps", "12",
         "--points", "2", "--steps-per-point", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 worker(s)" in proc.stdout and "critical batch" in proc.stdout
    got = json.loads(out.read_text())
    assert got["world_size"] == 2 and [p["step"] for p in got["points"]] == [4, 12]
    assert not any(p["biased"] for p in got["points"])  # local vs all-reduced: unbiased
