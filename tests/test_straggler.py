"""Straggler detection and its actions: the arithmetic, the sampler's shares, a real slowed
worker (SIGSTOP/SIGCONT from the test) on 2 gloo workers, rebalancing that keeps the exact
big-batch step, and stop with its own exit status."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.adaptive.straggler import (
    EXIT_STRAGGLER,
    StragglerDetector,
    apportion,
    rebalance,
    slowness,
)
from bigbatch.config.strategy import Strategy
from bigbatch.tasks.sampler import GlobalBatchSampler
from tests._dist import run_workers

# ---------------------------------------------------------------- arithmetic


def test_slowness_is_against_the_median_of_the_other_ranks():
    assert slowness([2.0, 1.0]) == [2.0, 0.5]              # two ranks: each against the other
    assert slowness([1.0, 1.0, 3.0, 1.2]) == pytest.approx([1 / 1.2, 1 / 1.2, 3 / 1.0, 1.2])
    assert math.isnan(slowness([1.0])[0])


def test_detector_flags_after_patience_windows_once_per_streak():
    d = StragglerDetector(threshold=1.5, patience=2)
    assert d.update([1.0, 1.6]) == []       # slow once
    assert d.update([1.0, 1.4]) == []       # not slow: the streak restarts
    assert d.update([1.0, 1.6]) == []
    assert d.update([1.0, 2.0]) == [1]      # two in a row
    assert d.update([1.0, 2.0]) == [] and d.slow == [1]
    assert d.update([1.0, 1.0]) == [] and d.slow == []
    again = StragglerDetector(1.5, 2)
    again.load_state_dict(d.state_dict())
    assert again.streaks == d.streaks


def test_rebalance_follows_speed_within_bounds_and_keeps_the_total():
    assert rebalance([64, 64], [0.01, 0.02]) == [85, 43]          # 2:1 speeds
    assert rebalance([85, 43], [0.0085, 0.0086]) == [85, 43]      # balanced stays
    assert rebalance([64, 64], [0.01, 0.1]) == [116, 12]
    assert rebalance([64, 64], [0.01, 1.0], max_factor=1.5) == [96, 32]  # the memory bound
    assert sum(rebalance([10, 10, 10], [1.0, 2.0, 3.0])) == 30
    assert apportion([1, 1, 1], 10, 1, 10) == [4, 3, 3]
    assert apportion([0, 0, 1], 6, 1, 4) == [1, 1, 4]


def test_sampler_shares_split_the_same_samples_per_step():
    even = [GlobalBatchSampler(100, 24, 6, world_size=2, rank=r, seed=1) for r in range(2)]
    moved = [GlobalBatchSampler(100, 24, 6, world_size=2, rank=r, seed=1) for r in range(2)]
    for s in moved:
        s.set_shares([4, 8])
    for a0, a1, b0, b1 in zip(*even, *moved, strict=True):
        assert [len(m) for m in b0] == [4, 4] and [len(m) for m in b1] == [8, 8]
        assert sorted(torch.cat(a0 + a1).tolist()) == sorted(torch.cat(b0 + b1).tolist())
    with pytest.raises(ValueError, match="summing to 12"):
        moved[0].set_shares([4, 4])


# ---------------------------------------------------------------- a real slowed worker

IN, HID = 256, 256


def _model(hid: int = HID) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, hid), nn.ReLU(), nn.Linear(hid, hid), nn.ReLU(),
                         nn.Linear(hid, 10))


def _strategy(straggler: dict, micro: int = 128) -> Strategy:
    return Strategy.from_dict({
        "batch": {"global_batch_size": 2 * micro, "base_batch_size": 2 * micro,
                  "base_lr": 0.01, "decay": "none"},
        "adaptive": {"policies": ["straggler"]}, "straggler": straggler})


def _detect_worker(steps: int, interval: int, patience: int, rows: int = 128,
                   hid: int = HID) -> dict:
    from bigbatch.engine import prepare

    rank = int(os.environ["RANK"])
    # Both workers on one core: on a shared machine another job's load then slows both
    # alike (it is the test's signal, not that load, that must make a straggler).
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    run = prepare(_model(hid), _strategy({"interval_steps": interval, "patience": patience},
                                          micro=rows),
                  total_steps=steps)
    policy = run.policies.get("straggler")
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(rows, IN, generator=g), torch.randint(0, 10, (rows,), generator=g)
    records = []
    while run.step < steps and not policy.flags:  # every rank sees a flag at the same step
        with run.micro_step() as ms:
            ms.backward(F.cross_entropy(run.model(x), y))
        records += run.policies.take_records()
    run.close()
    return {"flags": policy.flags, "records": records, "steps": run.step}


def _slow_down(rank: int, stop_s: float, run_s: float):
    """`on_start` for run_workers: SIGSTOP / SIGCONT one worker until it exits."""
    def start(procs):
        pid = procs[rank].pid

        def loop():
            while procs[rank].is_alive():
                try:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(stop_s)
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    return
                time.sleep(run_s)

        threading.Thread(target=loop, daemon=True).start()
    return start


@pytest.mark.slow  # ~30 s of real slowness
def test_worker_slowed_by_sigstop_is_flagged_within_3_windows():
    interval = 10
    # Compute well above the all-reduce, so that most stops land in compute: fewer windows
    # where chance spares the slowed worker.
    r0, r1 = run_workers(_detect_worker, 2, (300, interval, 2, 512, 512), timeout=240,
                         on_start=_slow_down(1, stop_s=0.01, run_s=0.005))
    assert r0["flags"] == r1["flags"] and r0["flags"], r0["records"]
    flag, = r0["flags"]
    assert flag["rank"] == 1 and flag["ratio"] > 1.5
    assert flag["step"] <= 3 * interval, r0["records"]
    windows = [r for r in r0["records"] if r["kind"] == "ranks"]
    assert [w["step"] for w in windows] == list(range(interval, flag["step"] + 1, interval))
    last = windows[-1]
    assert last["compute_s"][1] > 1.5 * last["compute_s"][0]
    assert last["sync_s"][0] > last["sync_s"][1]  # the fast rank waits for the slow one
    straggler, = [r for r in r0["records"] if r["kind"] == "straggler"]
    assert straggler["rank"] == 1 and straggler["host"]


@pytest.mark.slow
def test_even_workers_are_never_flagged_over_200_steps():  # 6 s quiet, ~25 s loaded
    r0, r1 = run_workers(_detect_worker, 2, (200, 20, 3), timeout=240)  # the defaults
    assert r0["steps"] == r1["steps"] == 200
    assert r0["flags"] == [] and r1["flags"] == [], r0["records"]
    windows = [r for r in r0["records"] if r["kind"] == "ranks"]
    assert len(windows) == 10 and all(min(w["compute_s"]) > 0 for w in windows)


# ---------------------------------------------------------------- rebalance: the exact step


def _exact_worker() -> dict:
    """Weights after 5 steps, by (loss kind, shares): one spawn for all four runs."""
    return {(count, None if shares is None else tuple(shares)): _exact_run(shares, count)
            for count in (False, True) for shares in (None, [5, 27])}


def _exact_run(shares: list[int] | None, count: bool) -> list[torch.Tensor]:
    from bigbatch.engine import prepare

    rank = int(os.environ["RANK"])
    s = Strategy.from_dict({"batch": {"global_batch_size": 64, "micro_batch_size": 16,
                                      "base_batch_size": 64, "base_lr": 0.1, "decay": "none"},
                            "gradient_merge": {"k_steps": 2}})
    run = prepare(_model(), s, total_steps=10)
    run.micro_batch_sizes = shares
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(5, 64, IN, generator=g), torch.randint(0, 10, (5, 64), generator=g)
    sizes = shares or [16, 16]
    start = sum(sizes[:rank])
    for t in range(5):
        for j in range(2):  # micro-step j holds rows [32 j, 32 j + 32), split by the shares
            rows = slice(32 * j + start, 32 * j + start + sizes[rank])
            with run.micro_step() as ms:
                out = run.model(x[t, rows])
                if count:
                    ms.backward(F.cross_entropy(out, y[t, rows], reduction="sum"),
                                count=sizes[rank])
                else:
                    ms.backward(F.cross_entropy(out, y[t, rows]))
    return [p.detach().clone() for p in run.module.parameters()]


def test_rebalanced_shares_give_the_even_step():
    r0, r1 = run_workers(_exact_worker, 2, timeout=180, init_group=True)
    for count in (False, True):  # mean losses are weighted by samples; summed ones divide
        even, moved = r0[(count, None)], r0[(count, (5, 27))]
        for a, b in zip(even, moved, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        for a, b in zip(moved, r1[(count, (5, 27))], strict=True):
            assert torch.equal(a, b)


REBALANCE = {"interval_steps": 2, "patience": 2, "action": "rebalance"}
SLOW = {1: 2e-4, 0: 1e-4}  # fake compute seconds per sample: rank 1 computes at half speed


def _fake_timing(run_box: list):
    """StepTiming.take reporting each rank's compute as its share x its speed."""
    def take(self):
        run = run_box[0]
        rank = run.mesh.data_rank
        share = (run.micro_batch_sizes or [run.plan.micro_batch_size] * 2)[rank]
        n = self.steps
        self.compute = self.data = self.sync = 0.0
        self.steps = 0
        return n * share * run.k_steps * SLOW[rank], 0.0, 0.0, n
    return take


def _train_runs(*runs: tuple) -> list:
    """`_train_worker(*args)` for each run in turn, in one spawn."""
    return [_train_worker(*args) for args in runs]


class _Crash(Exception):
    pass


def _train_worker(out: str, straggler: dict | None, steps: int, checkpoint_every: int,
                  crash_at: int | None = None, resume: bool = False):
    import bigbatch.engine.run as engine_run
    from bigbatch.engine.step_timing import StepTiming
    from bigbatch.train.trainer import TrainConfig, train

    box: list = []
    original = engine_run.Run.__init__

    def keep(self, *a, **kw):
        original(self, *a, **kw)
        box.append(self)

    engine_run.Run.__init__ = keep
    StepTiming.take = _fake_timing(box)
    import bigbatch.train.trainer as T

    rng_state, calls = T.rng_state, []

    def crash():  # the `crash_at`-th checkpoint dies, on every worker
        calls.append(1)
        if len(calls) == crash_at:
            raise _Crash
        return rng_state()

    T.rng_state = crash
    text = """
[batch]
global_batch_size = 128
micro_batch_size = 32
base_batch_size = 128
base_lr = 0.05
decay = "none"

[gradient_merge]
k_steps = 2
"""
    strategy = Strategy.from_toml(text)
    if straggler is not None:
        strategy = strategy.with_overrides(
            ['adaptive.policies=["straggler"]'] + [f"straggler.{k}={v!r}".replace("'", '"')
                                                   for k, v in straggler.items()])
    config = TrainConfig(task="mnist1d", model="mlp", task_options={"num_samples": 1000},
                         steps=steps, out=out, checkpoint_every=checkpoint_every, log_every=1,
                         progress=False, tensorboard=False, resume=resume)
    from bigbatch.errors import PolicyStop

    try:
        summary = train(config, strategy)
    except PolicyStop as e:
        return {"stopped": (str(e), e.status), "step": box[0].step}
    except _Crash:
        return "crashed"
    finally:
        engine_run.Run.__init__ = original
        T.rng_state = rng_state
    return {"summary": summary, "shares": box[0].micro_batch_sizes}


def _records(out, kind):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


@pytest.mark.usefixtures("train_env")
def test_rebalance_in_the_main_job_keeps_the_batch_and_equals_the_even_run(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    from bigbatch.tasks import get_task

    get_task("mnist1d", num_samples=1000)  # the data cache, before the workers
    (_, moved), _ = run_workers(_train_runs, 2, (
        (str(tmp_path / "even"), None, 12, 100), (str(tmp_path / "moved"), REBALANCE, 12, 100)),
        timeout=240, init_group=True)
    assert moved["shares"] == [43, 21]  # 2:1 speeds over 2 x 32 samples
    change, = _records(tmp_path / "moved", "rebalance")
    assert (change["step"], change["old"], change["new"]) == (4, [32, 32], [43, 21])
    flag, = _records(tmp_path / "moved", "straggler")
    assert flag["rank"] == 1 and flag["ratio"] == pytest.approx(2.0)
    assert [r["micro_batch_sizes"] for r in _records(tmp_path / "moved", "ranks")] == [
        [32, 32], [32, 32], [43, 21], [43, 21], [43, 21], [43, 21]]
    assert {r["global_batch_size"] for r in _records(tmp_path / "moved", "train")} == {128}
    a = torch.load(tmp_path / "even" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "moved" / "final.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5)
    ea = [r["loss"] for r in _records(tmp_path / "even", "train")]
    eb = [r["loss"] for r in _records(tmp_path / "moved", "train")]
    assert eb == pytest.approx(ea, rel=1e-5)

    # The monitor shows the per-rank times with the straggler marked, in text and figure.
    from bigbatch.cli.main import main

    assert main(["monitor", str(tmp_path / "moved"), "--once"]) == 0
    text = capsys.readouterr().out
    assert "STRAGGLER (flagged at step 4; now 0.98x)" in text and "[32, 32] -> [43, 21]" in text
    assert main(["monitor", str(tmp_path / "moved"), "--png"]) == 0
    assert (tmp_path / "moved" / "monitor.png").stat().st_size > 20_000


@pytest.mark.slow  # ~30 s on a loaded 2-core box: three trainings on two workers
@pytest.mark.usefixtures("train_env")
def test_a_rebalanced_run_resumes_exactly(tmp_path):
    from bigbatch.tasks import get_task

    get_task("mnist1d", num_samples=1000)
    full, cut = tmp_path / "full", tmp_path / "cut"
    (_, crashed, resumed), _ = run_workers(_train_runs, 2, (
        (str(full), REBALANCE, 12, 100),
        (str(cut), REBALANCE, 12, 3, 3),            # killed at its third checkpoint, step 9
        (str(cut), REBALANCE, 12, 3, None, True)),  # resumed from step 6
        timeout=240, init_group=True)
    assert crashed == "crashed"
    assert resumed["shares"] == [43, 21]  # from the step-6 checkpoint, after the rebalance
    a = torch.load(full / "final.pt", weights_only=True)
    b = torch.load(cut / "final.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.usefixtures("train_env")
def test_stop_checkpoints_and_ends_with_its_own_status(tmp_path):
    from bigbatch.tasks import get_task
    from bigbatch.train.checkpoint import latest_checkpoint

    get_task("mnist1d", num_samples=1000)
    out = tmp_path / "stop"
    r0, r1 = run_workers(_train_worker, 2, (str(out), {
        "interval_steps": 3, "patience": 1, "action": "stop"}, 12, 100), timeout=180)
    assert r0["step"] == r1["step"] == 3
    message, status = r0["stopped"]
    assert status == EXIT_STRAGGLER == 75 and message.startswith("straggler: rank 1 (host ")
    assert latest_checkpoint(out).name == "step-000000003.pt"
    assert json.loads((out / "stopped.json").read_text())["status"] == 75
