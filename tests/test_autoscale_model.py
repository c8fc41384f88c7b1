"""The autoscaler's ``model`` rule (`bigbatch train --nproc MIN:MAX --autoscale-rule model`):
Pollux's throughput model, fitted to the sizes measured so far, predicts the others; the
job jumps to the predicted best and skips sizes predicted to lose, and a measurement always
overrides a prediction. On synthetic step times drawn from a known throughput curve, then
through the launcher (`run_autoscaled`) with a launch that writes those numbers, and (slow)
a real MNIST-1D job (docs/adaptive.md, "Predicting the sizes not measured")."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from bigbatch.adaptive.autoscale import Autoscaler, Measurement
from bigbatch.adaptive.goodput import ThroughputParams, efficiency, step_time
from bigbatch.adaptive.size_forecast import fit_sizes, ready
from bigbatch.cli.autoscale import _plan_at, add_autoscale_arguments, run_autoscaled
from bigbatch.config.strategy import Strategy

# Compute 2 ms + 0.1 ms per example, a sync of 4 ms on two workers growing 1.5 ms per
# worker: with 960 examples per step (kept over any size) throughput peaks at 8 workers,
# and the marginal efficiency falls below 0.5 after 4.
SYNC_GROWS = ThroughputParams(alpha_c=0.002, beta_c=1e-4, alpha_n=0.004, beta_n=0.0015)
BATCH = 960


def _rate(n: int, true=SYNC_GROWS, batch=BATCH) -> float:
    return batch / step_time(true, batch // n, 1, n)


def _drive(rule: str, lo=1, hi=12, threshold=0.5, rate=_rate, **kw):
    """The sizes one rule visits on the curve `rate`, and its decisions."""
    a = Autoscaler(lo, hi, threshold=threshold, rule=rule, **kw)
    n, visited, decisions = lo, [lo], []
    for i in range(1, 30):
        split = a.plan(n, Measurement(n, 0.0, 0, BATCH)) or (BATCH // n, 1)
        d = a.observe(Measurement(n, rate(n), 10 * i, BATCH, micro_batch_size=split[0],
                                  k_steps=split[1]))
        decisions.append(d)
        n = d.new
        visited.append(n)
        if d.settled:
            return visited, decisions
    raise AssertionError("the rule never settled")


def test_the_fit_needs_three_sizes_two_of_them_multi_worker():
    ms = [Measurement(n, _rate(n), 10, BATCH, micro_batch_size=BATCH // n) for n in (1, 2, 3)]
    assert not ready(ms[:2]) and fit_sizes(ms[:2]) is None
    assert ready(ms)
    # without the batch split nothing can be fitted
    assert not ready([Measurement(n, _rate(n), 10) for n in (1, 2, 3)])


@pytest.mark.parametrize("threshold,want", [(0.0, 8), (0.5, 4)])
def test_the_model_settles_where_stepping_does_in_fewer_segments(threshold, want):
    step, _ = _drive("step", threshold=threshold)
    model, ds = _drive("model", threshold=threshold)
    assert step[-1] == model[-1] == want
    measured_step, measured_model = len(set(step)), len(set(model))
    assert measured_model < measured_step, (step, model)
    print(f"threshold {threshold}: step rule measured {step[:-1]}, model rule {model[:-1]}")
    # 1 and 2 by stepping; the model takes over once 3 is measured and jumps straight to the
    # size it predicts best; that measurement confirms it and the job settles there
    assert model == [1, 2, 3, want, want]
    assert [d.rule for d in ds] == ["step", "step", "model", "model"]
    jump, confirm = ds[2], ds[3]
    assert jump.new == want and not jump.settled and "jump to" in jump.reason
    assert confirm.forecast == pytest.approx(_rate(want), rel=0.02)  # predicted before measured
    assert f"(predicted {confirm.forecast:.4g})" in confirm.reason
    if threshold == 0.5:
        # 5 and 6 are predicted to lose (the added workers pay < 0.5 of linear): not measured
        assert "not measured (predicted to lose): 5, 6" in jump.reason


def test_a_wrong_prediction_loses_to_the_measurement():
    # A cliff the smooth model cannot see from 1-3 workers: from 5 workers on (another
    # machine, say) every step is 3x slower. The model jumps to 8, measures a third of what
    # it predicted, stops skipping sizes and steps up from the best measured size instead.
    def cliff(n: int) -> float:
        return _rate(n) * (1 / 3 if n >= 5 else 1.0)

    step, _ = _drive("step", threshold=0.0, rate=cliff)
    model, ds = _drive("model", threshold=0.0, rate=cliff)
    assert step == [1, 2, 3, 4, 5, 4]
    assert model == [1, 2, 3, 8, 4, 5, 4]
    missed = ds[3]
    assert missed.forecast == pytest.approx(_rate(8), rel=0.02)
    assert missed.measured[8] == pytest.approx(cliff(8), rel=1e-3)
    assert "did not pay" in missed.reason and missed.rule == "step"
    last = ds[-1]
    assert last.settled and last.new == 4 and last.measured[4] == max(last.measured.values())


def test_goodput_not_throughput_under_a_growing_batch():
    # batch.elastic = "scale": 64 per worker, the global batch grows with the workers.
    # Throughput keeps scaling, but with a noise scale of 100 (base batch 64) the
    # statistical efficiency falls faster than throughput rises past 8 workers.
    true = ThroughputParams(alpha_c=0.002, beta_c=1e-4, alpha_n=0.001, beta_n=0.0002)
    noise, base = 100.0, 64

    def plan(n, last):
        return 64, 1

    a = Autoscaler(1, 12, threshold=0.0, rule="model", plan=plan, base_batch_size=base)
    n, goods = 1, {}
    for i in range(1, 20):
        b = 64 * n
        sps = b / step_time(true, 64, 1, n)
        eff = efficiency(b, noise, base)
        goods[n] = sps * eff
        d = a.observe(Measurement(n, sps, 10 * i, b, eff, micro_batch_size=64, k_steps=1,
                                  noise_scale=noise))
        n = d.new
        if d.settled:
            break
    want = max(range(1, 13), key=lambda k: 64 * k / step_time(true, 64, 1, k)
               * efficiency(64 * k, noise, base))
    assert d.new == want == max(goods, key=goods.get), d.reason
    assert d.predicted_goodput[want] == pytest.approx(goods[want], rel=0.05)
    assert d.predicted[12] > d.predicted[want]  # faster, but worth less per example


def test_a_jump_target_that_cannot_start_is_replaced():
    a = Autoscaler(1, 12, threshold=0.0, rule="model")
    for i, n in enumerate((1, 2)):
        a.observe(Measurement(n, _rate(n), 10 * i, BATCH, micro_batch_size=BATCH // n))
    d = a.observe(Measurement(3, _rate(3), 30, BATCH, micro_batch_size=BATCH // 3))
    assert d.new == 8
    d = a.cannot_start(8, "out of memory")
    assert d.rule == "model" and "8 workers cannot run this job" in d.reason
    assert d.new not in (3, 8) and 8 not in d.predicted, d.reason


def test_records_carry_prediction_and_measurement():
    _, ds = _drive("model", threshold=0.0)
    rec = ds[-1].record(step=50)
    json.dumps(rec)
    assert rec["rule"] == "model" and rec["forecast"] == pytest.approx(_rate(8), rel=0.02)
    assert set(rec["measured"]) == {"1", "2", "3", "8"}
    assert set(rec["predicted"]) == set(rec["predicted_goodput"]) >= {"1", "2", "3", "8", "12"}
    assert rec["predicted"]["8"] == pytest.approx(rec["measured"]["8"], rel=0.02)
    # sizes the global batch does not split over are not predicted (7, 9, 11 of 960)
    assert not {"7", "9", "11"} & set(rec["predicted"])


def test_plan_follows_batch_elastic():
    last = Measurement(2, 100.0, 10, 48, micro_batch_size=24, k_steps=1)
    keep = Strategy.from_toml("[batch]\nglobal_batch_size = 48\nbase_batch_size = 16\n"
                              'elastic = "keep"\n')
    assert _plan_at(keep, 3, last) == (16, 1) and _plan_at(keep, 5, last) is None
    scale = Strategy.from_toml("[batch]\nglobal_batch_size = 48\nbase_batch_size = 16\n"
                               'elastic = "scale"\n')
    assert _plan_at(scale, 5, last) == (24, 1)


# ----------------------------------------------------------------------------- the launcher


def _launcher_args(out: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_autoscale_arguments(parser)
    args = parser.parse_args(list(flags))
    args.out, args.resume, args.overwrite = str(out), False, False
    args.nnodes = args.rdzv_endpoint = None
    return args


def test_the_launcher_logs_predicted_against_measured(tmp_path, capsys):
    """run_autoscaled with a launch that, instead of training, writes what a segment at
    ``args.nproc`` workers would measure on the synthetic curve (and its train lines)."""
    out = tmp_path / "run"
    out.mkdir()
    metrics = out / "metrics.jsonl"
    strategy = Strategy.from_toml(f"[batch]\nglobal_batch_size = {BATCH}\n"
                                  'base_batch_size = 64\nelastic = "keep"\n')
    total, sizes = 60, []

    def resolve(args):
        return SimpleNamespace(out=str(out)), strategy

    def launch(args, argv, config, s):
        import os

        n = args.nproc
        sizes.append(n)
        lines = [json.loads(x) for x in metrics.read_text().splitlines()] if (
            metrics.exists()) else []
        start = max((r["step"] for r in lines), default=0)
        until = int(os.environ.get("BIGBATCH_AUTOSCALE_UNTIL", total))
        with open(metrics, "a") as f:
            for step in range(start + 1, min(until, total) + 1):
                f.write(json.dumps({"kind": "train", "step": step}) + "\n")
            if until <= total and "BIGBATCH_AUTOSCALE_UNTIL" in os.environ:
                f.write(json.dumps({
                    "kind": "autoscale_measure", "step": until, "world_size": n,
                    "samples_per_s": _rate(n), "global_batch_size": BATCH,
                    "micro_batch_size": BATCH // n, "k_steps": 1, "noise_scale": math.nan,
                    "efficiency": 1.0}) + "\n")
        return 0

    args = _launcher_args(out, "--autoscale-steps", "5", "--autoscale-rule", "model",
                          "--autoscale-threshold", "0.5", "--autoscale-margin", "0.05")
    assert run_autoscaled(args, [], 1, 12, resolve, launch) == 0
    assert sizes == [1, 2, 3, 4, 4]
    decisions = json.loads((out / "autoscale.json").read_text())["decisions"]
    assert [d["rule"] for d in decisions] == ["step", "step", "model", "model"]
    jump, settle = decisions[2], decisions[3]
    assert (jump["new"], settle["new"], settle["settled"]) == (4, 4, True)
    assert settle["forecast"] == pytest.approx(_rate(4), rel=0.02)
    assert "5" in jump["predicted"] and "5" not in settle["measured"]
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r for r in records if r["kind"] == "autoscale"] == decisions
    err = capsys.readouterr().err
    assert "jump to 4 workers: predicted" in err and "predicted 1 worker(s)" in err
    assert f"measured {_rate(4):.4g} samples/s at 4 workers (predicted" in err


def test_the_model_finds_a_size_past_a_growth_that_did_not_pay():
    # A fixed sync of 6 ms whatever the size, 10 ms of compute per 960 examples: two
    # workers (5 + 6 ms) are slower than one (10 ms), so stepping stops at one; eight
    # (1.25 + 6 ms) are 1.4x faster. The model rule measures its three sizes anyway.
    fixed = ThroughputParams(alpha_c=0.0, beta_c=1e-5 * 1000 / BATCH, alpha_n=0.006, beta_n=0.0)

    def rate(n):
        return _rate(n, true=fixed)

    step, _ = _drive("step", hi=8, threshold=0.0, rate=rate)
    model, ds = _drive("model", hi=8, threshold=0.0, rate=rate)
    assert step == [1, 2, 1]
    assert model == [1, 2, 3, 8, 8], [d.reason for d in ds]
    assert "the model needs three sizes measured" in ds[0].reason
    assert ds[-1].measured[8] > 1.3 * ds[-1].measured[1]


@pytest.mark.slow  # ~40 s on 2 cores: 4 launches (3 measured segments, then the settled one)
def test_a_real_job_records_the_models_prediction(tmp_path):
    """MNIST-1D, `--nproc 1:4 --autoscale-rule model`: 1, 2 and 3 workers measured, then the
    model's decision with its prediction for 4 workers, which is not measured when it is
    predicted to lose (this 2-core box: one worker is fastest)."""
    from _cli import run_cli
    from test_autoscale import STRATEGY, _args

    cfg = tmp_path / "s.toml"
    cfg.write_text(STRATEGY)
    out = tmp_path / "auto"
    p = run_cli([*_args(cfg, out), "--nproc", "1:4", "--autoscale-steps", "6",
                 "--autoscale-rule", "model"], tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    decisions = json.loads((out / "autoscale.json").read_text())["decisions"]
    print("\n".join(d["reason"] for d in decisions))
    assert [d["rule"] for d in decisions[:2]] == ["step", "step"]
    model = decisions[2]
    assert model["rule"] == "model" and set(model["measured"]) == {"1", "2", "3"}
    assert set(model["predicted"]) == set(model["predicted_goodput"]) == {"1", "2", "3", "4"}
    # Not compared with the measurements: 2 and 3 gloo workers on 2 shared cores measure
    # noisy times the model's shape need not go through (3 faster than 2, say).
    assert all(math.isfinite(v) and v > 0 for v in model["predicted"].values())
    if model["settled"]:  # 4 predicted to lose: never measured
        assert "not measured (predicted to lose): 4" in model["reason"]
        best = max(model["measured"], key=model["measured"].get)
        assert model["new"] == int(best) and len(decisions) == 3
    else:  # predicted to win: measured next, with the prediction beside the measurement
        assert decisions[3]["forecast"] == pytest.approx(model["predicted"]["4"], rel=1e-3)
    assert "; predicted 1 worker(s)" in p.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in lines if x["kind"] == "autoscale"] == decisions
