"""The autoscaler of `bigbatch train --nproc MIN:MAX`: its rule on synthetic throughput
numbers, and (slow) a real job on MNIST-1D that settles on the size measured fastest here
and ends with the weights of the same size changes made by hand (the command of
docs/adaptive.md, "Picking the number of workers", at a test's size)."""

from __future__ import annotations

import json

import pytest
import torch

from bigbatch.adaptive.autoscale import Autoscaler, Measurement, marginal_efficiency
from bigbatch.cli.autoscale import parse_range
from bigbatch.errors import ConfigError


def _drive(rates: dict[int, float], lo=1, hi=4, threshold=0.5, step=1, eff=None):
    """Run the rule on made-up samples/s per size; the sizes visited and the last decision."""
    rule = Autoscaler(lo, hi, step=step, threshold=threshold)
    n, visited = lo, [lo]
    for _ in range(10):
        d = rule.observe(Measurement(n, rates[n], 10 * len(visited),
                                     efficiency=(eff or {}).get(n, 1.0)))
        n = d.new
        visited.append(n)
        if d.settled:
            return visited, d
    raise AssertionError("the rule never settled")


def test_marginal_efficiency():
    a, b = Measurement(2, 200.0, 0), Measurement(4, 300.0, 0)
    assert marginal_efficiency(a, b) == pytest.approx(0.5)  # +100 of a linear +200
    assert marginal_efficiency(a, Measurement(4, 400.0, 0)) == pytest.approx(1.0)
    assert marginal_efficiency(a, Measurement(4, 150.0, 0)) < 0


def test_grows_while_scaling_pays_and_stops_at_max():
    visited, d = _drive({1: 100, 2: 190, 3: 270, 4: 350})
    assert visited == [1, 2, 3, 4, 4] and d.settled
    assert "largest allowed" in d.reason and d.measured == {1: 100, 2: 190, 3: 270, 4: 350}


def test_goes_back_to_the_best_size_when_a_growth_does_not_pay():
    visited, d = _drive({1: 100, 2: 180, 3: 200, 4: 500})  # 2 -> 3: marginal 0.22
    assert visited == [1, 2, 3, 2] and d.new == 2
    assert "0.22 < threshold 0.50" in d.reason and d.marginal == pytest.approx(0.2222, abs=1e-3)


def test_slower_with_more_workers_settles_at_one():
    # This machine: 2 cores, gloo, a small model: two workers are slower than one.
    visited, d = _drive({1: 50_000, 2: 12_000, 3: 9_000, 4: 8_000})
    assert visited == [1, 2, 1] and d.settled
    assert "settle at 1 workers" in d.reason


def test_goodput_must_improve_too():
    # Throughput scales, but the batch grew (elastic = scale) past the noise scale's worth.
    visited, d = _drive({1: 100, 2: 190, 3: 280, 4: 370}, eff={1: 1.0, 2: 0.9, 3: 0.5, 4: 0.4})
    assert visited == [1, 2, 3, 2] and "goodput" in d.reason


def test_step_and_range():
    visited, _ = _drive({2: 100, 4: 200, 6: 290, 8: 300}, lo=2, hi=8, step=2)
    assert visited == [2, 4, 6, 8, 6]
    assert _drive({3: 10}, lo=3, hi=3)[0] == [3, 3]


def test_a_size_the_batch_does_not_split_over_is_skipped():
    # 1 and 2 workers measured; 3 cannot start (128 does not split over 3): try 4.
    rule = Autoscaler(1, 4)
    rule.observe(Measurement(1, 100, 10))
    assert rule.observe(Measurement(2, 190, 20)).new == 3
    d = rule.cannot_start(3, "global batch 128 is not a multiple of 3 workers")
    assert (d.new, d.settled) == (4, False) and "128" in d.reason
    assert rule.observe(Measurement(4, 360, 30)).settled
    # with nothing above it left, the rule settles at the best size measured
    rule = Autoscaler(1, 3)
    rule.observe(Measurement(1, 100, 10))
    rule.observe(Measurement(2, 190, 20))
    d = rule.cannot_start(3, "no split")
    assert (d.new, d.settled) == (2, True)


def test_a_lost_worker_shrinks_and_caps():
    rule = Autoscaler(1, 4)
    rule.observe(Measurement(1, 100, 10))
    rule.observe(Measurement(2, 190, 20))
    d = rule.lost_worker(3)
    assert (d.new, rule.ceiling) == (2, 2) and "lost" in d.reason
    assert rule.observe(Measurement(2, 190, 30)).settled  # no growth past the cap


def test_decision_records_are_metrics_lines():
    _, d = _drive({1: 100, 2: 50})
    rec = d.record(step=20)
    assert rec["kind"] == "autoscale" and rec["step"] == 20 and (rec["old"], rec["new"]) == (2, 1)
    assert rec["measured"] == {"1": 100, "2": 50}
    json.dumps(rec)


@pytest.mark.parametrize("text", ["0:2", "3:2", "a:b", "2:"])
def test_bad_ranges_name_the_flag_and_the_rule(text):
    with pytest.raises(ConfigError, match=r"--nproc .*: expected N or MIN:MAX with integers "
                                          r"1 <= MIN <= MAX"):
        parse_range(text)
    assert parse_range("2") is None and parse_range("1:4") == (1, 4)


STRATEGY = """
[batch]
global_batch_size = 48
base_batch_size = 16
base_lr = 0.05
warmup_steps = 2
elastic = "keep"

[lars]
lars_coeff = 0.01
"""


def _args(cfg, out):
    return ["train", "--config", str(cfg), "--task", "mnist1d", "--model", "mlp", "--task-opt",
            "num_samples=600", "--steps", "24", "--checkpoint-every", "100", "--no-progress",
            "--no-tensorboard", "--out", str(out)]


@pytest.mark.slow  # ~75 s on 2 cores: 6 launches (3 autoscaled segments, then 3 by hand)
def test_autoscaled_job_settles_on_the_fastest_size_and_equals_the_changes_by_hand(tmp_path):
    from _cli import run_cli

    cfg = tmp_path / "s.toml"
    cfg.write_text(STRATEGY)
    auto = tmp_path / "auto"
    p = run_cli([*_args(cfg, auto), "--nproc", "1:4", "--autoscale-steps", "6"], tmp_path,
                timeout=300)
    assert p.returncode == 0, p.stderr
    decisions = json.loads((auto / "autoscale.json").read_text())["decisions"]
    last = decisions[-1]
    measured = {int(k): v for k, v in last["measured"].items()}
    fastest = max(measured, key=measured.get)
    assert last["settled"] and last["new"] == fastest, last
    assert f"settle at {fastest} workers" in last["reason"]
    assert "autoscale at step" in p.stderr and "samples/s" in p.stderr
    lines = [json.loads(x) for x in (auto / "metrics.jsonl").read_text().splitlines()]
    assert [x["new"] for x in lines if x["kind"] == "autoscale"] == [d["new"] for d in decisions]
    # recorded among the run's files, so --overwrite removes it with the rest
    assert "autoscale.json" in json.loads((auto / ".bigbatch-files.json").read_text())["files"]
    print("measured samples/s by workers:", measured, "->", fastest)

    # The same size changes by hand: each segment stopped at the same step (the segment
    # policy the autoscaler uses, asked for through its environment variable).
    hand = tmp_path / "hand"
    sizes, stops = [1] + [d["new"] for d in decisions], [d["step"] for d in decisions] + [None]
    for i, (n, stop) in enumerate(zip(sizes, stops, strict=True)):
        env = {} if stop is None else {"BIGBATCH_AUTOSCALE_UNTIL": str(stop)}
        p = run_cli([*_args(cfg, hand), "--nproc", str(n), *(["--resume"] if i else [])],
                    tmp_path, timeout=120, **env)
        assert p.returncode == 0, p.stderr
    a = torch.load(auto / "final.pt", weights_only=True)
    b = torch.load(hand / "final.pt", weights_only=True)
    wa, wb = a.get("model", a), b.get("model", b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
