"""`batch.schedule = "adaptive"` / `"seesaw"`: a global batch that grows during the run.

The rules (`bigbatch.adaptive.batch_growth`), the start and ceiling plans, the engine's
policy (doublings, LR, the schedule counted in samples), what it refuses, and the main
job: the changes in metrics.jsonl and a killed run resuming to the same weights.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_engine import ONE, make_data, make_model, strategy

from bigbatch.adaptive.batch_growth import NoiseScaleGrowth, SeesawGrowth, doublings
from bigbatch.adaptive.gns import adam_sq_norm, sq_norm
from bigbatch.config.strategy import Strategy
from bigbatch.engine import prepare
from bigbatch.engine.batch_schedule import MIN_ESTIMATES, decay_factor
from bigbatch.errors import ConfigError

NAN = math.nan


def grow(mode="adaptive", ceiling=256, micro=None, **batch):
    extra = {"schedule": mode, "start_batch_size": 32, "schedule_interval_steps": 1, **batch}
    s = strategy("sgd", ceiling, micro, gradient_merge={"avg": True})
    return s.with_overrides([f"batch.{k}={v}" for k, v in extra.items()])


def feed(run, x, y, steps):
    """`steps` optimizer steps, each on the first rows of the next slice of (x, y)."""
    for t in range(steps):
        m, k = run.plan.micro_batch_size, run.k_steps
        for i in range(k):
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[t, i * m:(i + 1) * m]),
                                            y[t, i * m:(i + 1) * m]))
        assert ms.stepped


# ---------------------------------------------------------------- the rules


def test_noise_rule_doubles_while_twice_the_batch_is_within_the_fraction_of_the_noise():
    rule = NoiseScaleGrowth(0.5)
    assert rule.decide(NAN, 64, 1024) is None and rule.decide(-3.0, 64, 1024) is None
    assert rule.decide(255.0, 64, 1024) is None     # 0.5 x 255 < 128
    assert rule.decide(256.0, 64, 1024) == 128
    assert rule.decide(1e9, 512, 1024) == 1024
    assert rule.decide(1100.0, 64, 1024) == 512     # three doublings at once: 512 <= 550
    assert rule.decide(1e9, 1024, 1024) is None     # the ceiling
    assert rule.decide(1e9, 600, 1024) is None      # 1200 would pass it


def test_seesaw_rule_doubles_each_time_the_decay_halves():
    rule = SeesawGrowth()
    assert rule.decide(1.0, 32, 32, 256) is None
    assert rule.decide(0.51, 32, 32, 256) is None
    assert rule.decide(0.5, 32, 32, 256) == 64
    assert rule.decide(0.3, 64, 32, 256) is None    # the second doubling waits for 1/4
    assert rule.decide(0.25, 64, 32, 256) == 128
    assert rule.decide(0.01, 256, 32, 256) is None
    assert doublings(128, 32) == 2 and doublings(32, 32) == 0


# ---------------------------------------------------------------- plans and refusals


def test_start_plan_is_the_start_batch_and_the_configured_one_the_ceiling():
    s = grow(ceiling=1024, micro=None)
    start, ceiling = s.resolve(1), s.ceiling(1)
    assert (ceiling.global_batch_size, ceiling.micro_batch_size) == (1024, 1024)
    # One worker: two merged micro-steps, so the noise scale is measured without bias.
    assert (start.global_batch_size, start.micro_batch_size, start.k_steps) == (32, 16, 2)
    assert start.peak_lr == pytest.approx(0.05 * math.sqrt(32 / 64))  # batch.scaling
    two = s.resolve(2)
    assert (two.global_batch_size, two.micro_batch_size, two.k_steps) == (32, 16, 1)
    small_micro = grow(ceiling=1024, micro=8).resolve(1)
    assert (small_micro.micro_batch_size, small_micro.k_steps) == (8, 4)
    assert strategy("sgd", 1024).resolve(1) == strategy("sgd", 1024).ceiling(1)


@pytest.mark.parametrize("overrides, message", [
    (["batch.start_batch_size=2048"], "batch.start_batch_size=2048 is larger than the ceiling"),
    (["batch.start_batch_size=33"], "not divisible by the 2 data-parallel workers"),
    (["batch.schedule=fixed"], 'batch.start_batch_size=32 needs batch.schedule = "adaptive"'),
    (["batch.schedule=steady"], "batch.schedule"),
])
def test_bad_start_or_schedule_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        grow(ceiling=1024).with_overrides(overrides).resolve(2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("sections, message", [
    ({"pipeline": {"pp_degree": 1}}, 'batch.schedule="adaptive" with [pipeline]'),
    ({"adaptive": {"batch_size": "goodput"}},
     'batch.schedule="adaptive" with adaptive.batch_size="goodput"'),
    ({"adaptive": {"lr": "adascale"}, "batch": {"scaling": "none"}},
     'batch.schedule="adaptive" with adaptive.lr="adascale"'),
    ({"sharding": {"stage": 3}}, 'batch.schedule="adaptive" with [sharding]: it follows'),
])
def test_what_a_growing_batch_does_not_combine_with_is_refused(sections, message):
    d = {**sections, "batch": {"global_batch_size": 256, "schedule": "adaptive",
                               **sections.get("batch", {})}}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        from bigbatch.config.compat import check

        check(Strategy.from_dict(d))


def test_overview_shows_the_growth():
    text = grow(ceiling=1024).overview(1, total_steps=50)
    assert "adaptive: 32 -> at most 1024" in text
    assert "2 x batch <= 1.25 x noise scale" in text and "50 of the start batch" in text


# ---------------------------------------------------------------- the engine


def test_seesaw_doubles_where_cosine_halves_and_counts_the_run_in_samples():
    # Linear scaling: each doubling doubles the peak, so the LR holds at each crossing
    # (Smith et al.'s "increase the batch instead of decaying the LR").
    s = grow("seesaw", ceiling=128).with_overrides(["batch.scaling=linear",
                                                    "batch.warmup_steps=0"])
    run = prepare(make_model(), s, total_steps=40, world=ONE)
    assert [p.name for p in run.policies] == ["batch_schedule"]
    x, y = make_data(40, 128)
    lrs, batches = [], []
    while not run.done:
        feed(run, x[len(lrs):], y[len(lrs):], 1)
        lrs.append(run.last_lr)
        batches.append(run.plan.global_batch_size)
    changes = [(c["step"], c["old"], c["new"]) for c in run.batch_size_changes]
    # Cosine over 40 units of 32 samples: 1/2 at unit 20, 1/4 at 26.7 (reached in steps of
    # 64 samples, 2 units each).
    assert changes[0] == (20, 32, 64) and changes[1][1:] == (64, 128) and len(changes) == 2
    assert run.progress == pytest.approx(40, abs=4)  # the sample budget, to the last step
    peak0 = 0.05 * 32 / 64
    # lrs[i]: the LR of step i + 1, read at progress i. The step after the first doubling
    # runs at twice the peak times the decay there (1/2): the LR of the start.
    assert lrs[19] == pytest.approx(peak0 * decay_factor(run.clock.schedule, 19))
    assert lrs[20] == pytest.approx(peak0 * 2 * decay_factor(run.clock.schedule, 20))
    assert lrs[20] == pytest.approx(peak0)
    assert sum(b for b in batches) == pytest.approx(40 * 32, abs=4 * 32)


def test_adaptive_grows_micro_then_merge_steps_as_the_noise_scale_grows():
    s = grow(ceiling=256, micro=32, noise_scale_fraction=1.0)
    run = prepare(make_model(), s, total_steps=200, world=ONE)
    assert run.adaptive is not None  # it tracks the noise scale for the schedule
    tracker = SimpleNamespace(b_simple=NAN, steps=0)
    run.adaptive.tracker, run.adaptive.flush = tracker, lambda: None
    run.grad_hooks.clear()  # the noise scale is the test's
    x, y = make_data(12, 256)
    seen = []
    for t, (noise, n) in enumerate([(1e6, MIN_ESTIMATES - 1), (50.0, MIN_ESTIMATES),
                                    (130.0, 20), (200.0, 21), (300.0, 22), (1e6, 23)]):
        tracker.b_simple, tracker.steps = noise, n
        feed(run, x[t:], y[t:], 1)
        seen.append((run.plan.global_batch_size, run.plan.micro_batch_size, run.k_steps))
    # Too few estimates for 1e6; 50 < 64; 130 doubles twice at once (micro up to its 32,
    # then merge steps); 200 < 256; 300 -> 256, the ceiling.
    assert seen == [(32, 16, 2), (32, 16, 2), (128, 32, 4), (128, 32, 4), (256, 32, 8),
                    (256, 32, 8)]
    assert [(c["step"], c["old"], c["new"]) for c in run.batch_size_changes] == [
        (3, 32, 128), (5, 128, 256)]
    assert "noise scale 130 x fraction 1 = 130 >= 128" in run.batch_size_changes[0]["reason"]
    # batch.scaling (sqrt, base 64) sets the start's peak; each doubling then follows
    # batch.growth_scaling (linear by default)
    assert run.clock.schedule.peak_lr == pytest.approx(0.05 * math.sqrt(32 / 64) * 256 / 32)


@pytest.mark.parametrize("rule, factor", [("linear", 8.0), ("sqrt", math.sqrt(8.0)),
                                          ("none", 1.0)])
def test_adaptive_peak_lr_follows_growth_scaling_from_the_start_batch(rule, factor):
    s = grow(ceiling=256, growth_scaling=rule)
    start = s.resolve(1)
    assert start.global_batch_size == 32
    assert start.peak_lr == pytest.approx(0.05 * math.sqrt(32 / 64))  # batch.scaling
    grown = s.batch_plan(256, 32, 8, 1)
    assert grown.peak_lr == pytest.approx(start.peak_lr * factor)
    assert f"follows {rule} scaling" in s.overview(1)
    # seesaw's rule is defined by batch.scaling: growth_scaling does not touch it
    seesaw = grow("seesaw", ceiling=256, growth_scaling=rule)
    assert seesaw.batch_plan(256, 32, 8, 1).peak_lr == pytest.approx(0.05 * 2)


# ---------------------------------------------------------------- the noise scale


def test_preconditioned_norm_ignores_coordinates_adam_has_never_seen():
    emb = torch.nn.Embedding(4, 3, dtype=torch.float64)
    opt = torch.optim.AdamW(emb.parameters(), lr=1e-3, eps=1e-6)
    emb(torch.tensor([0, 1])).sum().backward()  # rows 2 and 3 get no gradient
    opt.step()
    v = opt.state[emb.weight]["exp_avg_sq"]
    assert (v[2:] == 0).all() and (v[:2] > 0).all()
    g = torch.ones(4, 3, dtype=torch.float64)  # now every row has a gradient
    got = float(adam_sq_norm(opt, [emb.weight], [g]))
    seen = g[:2] / ((v[:2] / (1 - 0.999)).sqrt() + 1e-6)
    assert got == pytest.approx(float(sq_norm([seen])), rel=1e-12)
    assert got < 1e3  # g / eps on the unseen rows would be 6e12


# ---------------------------------------------------------------- the main job

MAIN_JOB = """
[batch]
global_batch_size = 256
micro_batch_size = 32
base_batch_size = 32
base_lr = 0.05
warmup_steps = 2
decay = "cosine"
schedule = "adaptive"
start_batch_size = 32
noise_scale_fraction = 16.0
schedule_interval_steps = 2

[gradient_merge]
avg = true

[optimizer]
type = "momentum"
weight_decay = 0.0
"""


@pytest.mark.usefixtures("train_env")
def test_main_job_records_each_doubling_and_a_killed_run_resumes_to_the_same_weights(tmp_path):
    import test_train as tt

    full = tt._config(tmp_path / "full", model="mlp", steps=60, checkpoint_every=4)
    cut = tt._config(tmp_path / "cut", model="mlp", steps=60, checkpoint_every=4)
    steps = tt._full_crash_resume(full, cut, MAIN_JOB, 5)
    assert steps[1] == "crashed" and steps[0] == steps[2]
    tt._assert_same_weights(tt._final(tmp_path / "full"), tt._final(tmp_path / "cut"))
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in rows if r["kind"] == "batch_size"]
    assert changes and all(c["new"] > c["old"] and (c["new"] // c["old"]).bit_count() == 1
                           and c["new"] % c["old"] == 0 for c in changes), changes
    assert changes[0]["old"] == 32 and "noise scale" in changes[0]["reason"]
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["samples"] >= 60 * 32 and summary["steps"] < 60  # fewer, larger steps
    cut_rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text()
                .splitlines()]
    assert [c["step"] for c in changes] == [
        c["step"] for c in cut_rows if c["kind"] == "batch_size"]


@pytest.mark.usefixtures("train_env")
def test_lr_find_sweeps_at_the_start_batch_and_never_grows_it(tmp_path, caplog):
    import logging

    import test_train as tt

    from bigbatch.train.trainer import train

    caplog.set_level(logging.INFO, logger="bigbatch.adaptive")
    out = tmp_path / "run"
    text = MAIN_JOB.replace('schedule = "adaptive"', 'schedule = "adaptive"\nlr_find = true')
    summary = train(tt._config(out, model="mlp", steps=40), Strategy.from_toml(text))
    assert summary["lr_find"]["global_batch_size"] == 32  # the start, not the ceiling
    grew = [r for r in caplog.records if "global batch" in r.getMessage()]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in rows if r["kind"] == "batch_size"]
    # Every doubling logged is one of the run's: the sweep (15 steps) never grew its batch.
    assert changes and len(grew) == len(changes)


@pytest.mark.parametrize("adaptive, schedule, want", [
    ({"noise_scale": True}, "fixed", True),           # AdaptDL's: what Adam's step sees
    ({}, "adaptive", False),                          # McCandlish's critical batch
    ({"gns_gradient": "preconditioned"}, "adaptive", True),
    ({"noise_scale": True, "gns_gradient": "raw"}, "fixed", False),
])
def test_which_gradient_the_noise_scale_of_adamw_is_of(adaptive, schedule, want):
    from bigbatch.engine.adaptive import preconditioned

    s = strategy("adamw", 256, gradient_merge={"avg": True}, adaptive=adaptive)
    s = s.with_overrides([f"batch.schedule={schedule}"])
    assert preconditioned(s) is want
    run = prepare(make_model(), s, total_steps=10, world=ONE)
    assert run.adaptive.preconditioned is want
    assert run.adaptive.warmup_steps == (10 if want else 0)


@pytest.mark.parametrize("opt, fraction", [("sgd", 1.25), ("lars", 1.25), ("adamw", 0.0075),
                                           ("lamb", 0.0075)])
def test_auto_is_the_noise_rule_at_its_family_fraction(opt, fraction):
    s = strategy(opt, 256, gradient_merge={"avg": True}).with_overrides(
        ["batch.schedule=auto", "batch.start_batch_size=32"])
    assert s.noise_scale_fraction == fraction
    run = prepare(make_model(), s, total_steps=10, world=ONE)
    policy, = run.policies
    assert policy.mode == "adaptive" and run.adaptive is not None
    assert policy.noise_rule.fraction == fraction
    text = s.overview(1)
    assert "auto = adaptive: 32 -> at most 256" in text
    assert f"2 x batch <= {fraction:g} x noise scale" in text
    assert f"{fraction:g} (unset: 1, adamw 0.0075)" in text
    # a fraction that is set wins over the family's
    assert s.with_overrides(["batch.noise_scale_fraction=0.5"]).noise_scale_fraction == 0.5
    # no worker holds the whole gradient under ZeRO or tensor parallelism: seesaw there
    for layout in ("sharding.enable=true", "tensor_parallel.tensor_parallel_degree=2"):
        assert "auto = seesaw: 32 -> at most 256" in s.with_overrides([layout]).overview(2)


def test_a_grown_run_is_compared_with_the_baseline_of_its_epoch_budget():
    from bigbatch.tasks import get_task
    from bigbatch.train.summary import run_summary

    recipe = get_task("mnist1d", num_samples=1000).recipe("cnn")
    task = SimpleNamespace(name="mnist1d", metric="accuracy", default_options=True,
                           recipe=lambda model: recipe)
    common = dict(task=task, model="cnn", metrics={"accuracy": 0.99}, steps=463,
                  samples=640_000, plan=grow(ceiling=4096).ceiling(1), world_size=1,
                  strategy=grow(ceiling=4096), seed=0, wall_time_s=1.0, samples_per_s=None)
    # The sampler counted 16.56 epochs: each epoch at 4096 drops a different remainder.
    assert run_summary(epochs=16.56, **common)["reference"] is None
    ref = run_summary(epochs=16.56, budget_epochs=16.0, **common)["reference"]
    assert ref["global_batch_size"] == 128 and ref["epochs"] == 16


def test_auto_keeps_the_batch_where_the_layout_cannot_change_it():
    from bigbatch.config.compat import check
    from bigbatch.tasks.charlm import DEMO_STRATEGY

    demo = Strategy.from_toml(DEMO_STRATEGY).with_overrides(["pipeline.pp_degree=2"])
    check(demo)  # the demo's "auto" does not refuse a pipeline: it keeps the batch there
    assert demo.resolve(2).global_batch_size == 128
    assert "auto = fixed in this layout" in demo.overview(2)
    with pytest.raises(ConfigError, match=r'batch.schedule="seesaw" with \[pipeline\]'):
        demo.with_overrides(["batch.schedule=seesaw"])


def test_the_default_start_fits_the_workers_and_the_ceiling():
    s = strategy("sgd", 256, gradient_merge={"avg": True}).with_overrides(
        ["batch.schedule=seesaw", "batch.base_batch_size=20"])
    assert s.resolve(8).global_batch_size == 24       # 20 rounded up to 8 workers
    assert s.resolve(64).global_batch_size == 64
    assert s.with_overrides(["batch.global_batch_size=16"]).resolve(1).global_batch_size == 16
    with pytest.raises(ConfigError, match="start_batch_size=20 is not divisible by the 8"):
        s.with_overrides(["batch.start_batch_size=20"]).resolve(8)  # given: strict
