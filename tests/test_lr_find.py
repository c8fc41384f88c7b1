"""The LR range test: an exponential sweep, a smoothed loss, the steepest descent before
divergence, and the scaling rule the suggestion implies."""

import json
import math

import pytest
import torch.nn.functional as F
from test_engine import make_data, make_model, strategy

from bigbatch.cli.main import main
from bigbatch.engine.prepare import prepare
from bigbatch.parallel.world import World
from bigbatch.study.lr_find import lr_find


def test_the_sweep_covers_the_range_and_suggests_before_divergence():
    run = prepare(make_model(), strategy("sgd", global_batch=256), total_steps=60, world=World())
    x, y = make_data(steps=60)
    seen = []

    def step(run, i):
        with run.micro_step() as ms:
            loss = F.cross_entropy(run.model(x[i]), y[i])
            ms.backward(loss)
        seen.append(run.last_lr)
        return float(loss.detach())

    result = lr_find(run, range(60), step, lr_min=1e-4, lr_max=1e3, steps=60)
    assert seen[0] == pytest.approx(1e-4) and seen[:2] == pytest.approx(result.lrs[:2])
    ratios = [b / a for a, b in zip(seen, seen[1:], strict=False)]
    assert ratios == pytest.approx([(1e7) ** (1 / 59)] * len(ratios))  # exponential
    assert result.diverged_at is not None and result.diverged_at < 1e3  # it blew up, and stopped
    assert result.lrs[0] < result.suggested_lr < result.diverged_at
    assert run.lr_scale == 1.0
    best = result.smoothed.index(min(result.smoothed))
    assert result.suggested_lr <= result.lrs[best]  # on the way down, not after the minimum
    scale = 256 / 64
    assert result.exponent == pytest.approx(math.log(result.suggested_lr / 0.05) / math.log(scale))


def test_cli_writes_json_and_png_and_names_a_rule(tmp_path, capsys, train_env):
    out = tmp_path / "lrf"
    code = main(["lr-find", "--task-opt", "num_samples=2000", "--steps", "30", "--out", str(out),
                 "--set", "batch.global_batch_size=256", "--min", "1e-3", "--max", "100"])
    assert code == 0
    said = capsys.readouterr().out
    data = json.loads((out / "lr_find.json").read_text())
    assert len(data["lrs"]) == len(data["losses"]) > 5 and data["rule"] in said
    assert (out / "lr_find.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--min", "1", "--max", "0.1"], "--min=1.0 must be below --max=0.1"),
    (["--steps", "1"], "--steps=1 is out of range"),
    (["--max", "inf"], "--max=inf is out of range"),
])
def test_bad_sweeps_are_refused_in_one_line(argv, message, tmp_path, capsys):
    code = main(["lr-find", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()


def _sweep_on_two_workers() -> dict:
    """Rank 1's own loss is 5x rank 0's: alone it would pass 4x its best sooner."""
    import os

    rank = int(os.environ["RANK"])
    run = prepare(make_model(), strategy("sgd", global_batch=256), total_steps=60)
    x, y = make_data(steps=60)

    def step(run, i):
        rows = slice(rank * 128, (rank + 1) * 128)
        with run.micro_step() as ms:
            loss = F.cross_entropy(run.model(x[i, rows]), y[i, rows])
            ms.backward(loss)
        return float(loss.detach()) * (5.0 if rank == 1 else 1.0) + (0.5 if rank == 1 else 0.0)

    batches = range(60 if rank == 0 else 40)  # rank 1 runs out of data first
    result = lr_find(run, batches, step, lr_min=1e-4, lr_max=1e3, steps=60)
    return {"lrs": result.lrs, "losses": result.losses}


def test_workers_sweep_in_step_on_the_mean_loss():
    from _dist import run_workers

    one, two = run_workers(_sweep_on_two_workers, world_size=2, timeout=120)
    assert one["lrs"] == two["lrs"] and one["losses"] == two["losses"]  # same steps, same loss
    assert len(one["lrs"]) <= 40  # rank 1 had 40 batches: nobody waited on it for a 41st
