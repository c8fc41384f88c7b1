"""The LR range test: an exponential sweep, a smoothed loss, the steepest descent before
divergence, and the scaling rule the suggestion implies."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_engine import make_data, make_model, strategy

from bigbatch.cli.main import main
from bigbatch.engine.prepare import prepare
from bigbatch.parallel.world import World
from bigbatch.study.lr_find import lr_find


def test_the_sweep_covers_the_range_and_suggests_before_divergence():
    run = prepare(make_model(), strategy("sgd", global_batch=256), total_steps=60, world=World())
    x, _ = make_data(steps=60)
    teacher = torch.Generator().manual_seed(3)
    y = (x @ torch.randn(x.shape[-1], 4, generator=teacher, dtype=x.dtype)).argmax(-1)
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


# ------------------------------------------------------------- [batch] lr_find in a run

LR_FIND_RUN = ["--task-opt", "num_samples=2000", "--nproc", "1", "--no-progress",
               "--no-tensorboard", "--set", "batch.global_batch_size=256",
               "--set", "batch.micro_batch_size=256", "--set", "batch.lr_find_steps=8",
               "--set", "batch.warmup_epochs=0", "--set", "batch.decay=\"none\""]


def _final_weights(out):
    return torch.load(out / "final.pt", weights_only=True)


def test_train_lr_find_records_the_lr_and_a_resume_keeps_it(tmp_path, capsys, train_env):
    out = tmp_path / "run"
    assert main(["train", "--lr-find", "--epochs", "1", "--out", str(out), *LR_FIND_RUN]) == 0
    said = "".join(capsys.readouterr())
    summary = json.loads((out / "summary.json").read_text())
    found = summary["lr_find"]
    curve = json.loads((out / found["curve_file"]).read_text())
    assert found["curve_file"] == "lr_find.json" and 2 <= found["steps"] <= 8
    assert curve["lr_find"] == found and len(curve["lrs"]) == len(curve["losses"]) >= 2
    assert found["time_s"] > 0 and summary["peak_lr"] == found["peak_lr"]
    assert found["scaled_lr"] == pytest.approx(0.1 * 256 / 128)  # the demo's base_lr, linear
    assert "lr_find" in said and f"{found['peak_lr']:.6g}" in said  # the overview's peak_lr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {m["lr"] for m in metrics if m["kind"] == "train"}
    assert lrs == {found["peak_lr"]}  # no warmup, no decay: the found peak

    assert main(["train", "--resume", "--epochs", "2", "--out", str(out), "--no-progress",
                 "--nproc", "1"]) == 0
    said = "".join(capsys.readouterr())
    assert "lr_find:" not in said and "resuming" in said  # no second sweep
    again = json.loads((out / "summary.json").read_text())
    assert again["lr_find"] == found and again["epochs"] == pytest.approx(2)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {m["lr"] for m in metrics if m["kind"] == "train"} == lrs  # the peak came back


def test_a_run_with_lr_find_trains_from_the_initial_weights(tmp_path, train_env):
    """The same run without the sweep, its base LR set to the found one, ends in the same
    weights: the sweep moved neither the model, the optimizer, the data order nor an RNG."""
    found_run, plain = tmp_path / "found", tmp_path / "plain"
    assert main(["train", "--lr-find", "--epochs", "1", "--out", str(found_run),
                 *LR_FIND_RUN]) == 0
    peak = json.loads((found_run / "summary.json").read_text())["lr_find"]["peak_lr"]
    assert main(["train", "--epochs", "1", "--out", str(plain), *LR_FIND_RUN,
                 "--set", "batch.scaling=\"none\"", "--set", f"batch.base_lr={peak!r}"]) == 0
    a, b = _final_weights(found_run), _final_weights(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lr_find_with_the_parameter_server_is_refused_in_one_line(tmp_path, capsys):
    code = main(["train", "--lr-find", "--set", "parameter_server.enable=true", "--nproc", "1",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "batch.lr_find with [parameter_server] is not supported" in err


def test_the_study_page_is_rendered_from_its_results():
    """docs/lr-find-study.md is what benchmarks/lr_find_study.py writes from the results
    beside it (regenerate: `python benchmarks/lr_find_study.py --from-json`)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("lr_find_study",
                                                  root / "benchmarks" / "lr_find_study.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    doc = root / "docs" / "lr-find-study.md"
    data = json.loads(doc.with_suffix(".json").read_text())
    assert doc.read_text() == study.page(data["cells"], data["seeds"])
    assert study.COMMAND in doc.read_text()
