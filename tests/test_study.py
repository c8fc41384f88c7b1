"""`bigbatch study`: a tiny sweep's report, restart and resume, steps to target, claims, errors."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

import bigbatch.cli.study as C
import bigbatch.study.sweep as S
from bigbatch.errors import ConfigError
from bigbatch.study.claims import claim_accuracy, claim_scaling, critical_batch
from bigbatch.study.config import QUICK
from bigbatch.study.report import _fit_mccandlish, steps_to_target
from bigbatch.study.sweep import StudyConfig, run_study

TINY = dict(task="mnist1d", model="mlp", task_options={"num_samples": 1000}, epochs=1,
            batches=[32, 64], strategies=["sgd", "lars"], micro_batch_size=32, progress=False)


@pytest.fixture(autouse=True)
def env(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "xdg-cache"  # shared: data generated once
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny study shared by the tests that only read it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    out = tmp_path_factory.mktemp("study")
    try:
        results = run_study(StudyConfig(**TINY, out=str(out)))
    finally:
        mp.undo()
    return out, results


def _counting(monkeypatch):
    """Record which cells train (and skip the figures: these tests are about the cells)."""
    monkeypatch.setattr("bigbatch.study.report.plot_all", lambda results, out: {})
    calls = []
    original = S._run_in_process

    def spy(cell, resume, threads=None):
        calls.append((cell.dir.name, resume))
        original(cell, resume, threads)

    monkeypatch.setattr(S, "_run_in_process", spy)
    return calls


def test_tiny_study_writes_report_results_and_figures(tiny):
    out, results = tiny
    for name in ("report.md", "results.json", "curves.png", "steps_to_target.png",
                 "noise_scale.png", "final_metric.png"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "results.json").read_text())
    cells = [(c["strategy"], c["global_batch_size"]) for c in saved["cells"]]
    assert cells == [("sgd", 32), ("sgd", 64), ("lars", 32), ("lars", 64)]
    for c in saved["cells"]:
        assert c["status"] == "ran" and c["steps"] == 800 // c["global_batch_size"]
        assert 0.0 <= c["final"] <= 1.0 and c["evals"] and c["noise_scale_series"]
        assert c["k_steps"] == c["global_batch_size"] // 32
    report = (out / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| sgd") or
            line.startswith("| lars")]
    assert [r.split("|")[1:3] for r in rows] == [
        [" sgd ", " 32 "], [" sgd ", " 64 "], [" lars ", " 32 "], [" lars ", " 64 "]]
    assert "| strategy | global batch | epochs | test accuracy |" in report
    assert len(saved["claims"]) == 2 and all(c["verdict"] for c in saved["claims"])
    # Cell outputs are train's, plus the study's record of the cell.
    assert (out / "cells" / "lars-b64" / "summary.json").is_file()
    assert (out / "cells" / "lars-b64" / S.CELL_FILE).is_file()


def test_restart_keeps_finished_cells_and_runs_new_ones(tiny, monkeypatch):
    out, _ = tiny
    before = (out / "cells" / "sgd-b32" / "summary.json").stat().st_mtime_ns
    calls = _counting(monkeypatch)
    results = run_study(StudyConfig(**TINY, out=str(out)))
    assert calls == [] and {c["status"] for c in results["cells"]} == {"kept"}
    assert (out / "cells" / "sgd-b32" / "summary.json").stat().st_mtime_ns == before
    # A changed cell (other override) is rerun; the others are kept.
    cfg = StudyConfig(**TINY, out=str(out), overrides={"lars": ["lars.lars_coeff=0.02"]})
    results = run_study(cfg)
    assert sorted(calls) == [("lars-b32", False), ("lars-b64", False)]
    assert [c["status"] for c in results["cells"]] == ["kept", "kept", "ran", "ran"]


def test_a_changed_family_default_reruns_the_cells_that_used_it(tiny, monkeypatch):
    """A default that unset keys take by optimizer family (here the range test's sweep
    length) is part of a cell's identity: changing it reruns those cells, and a cell
    file written before these values were recorded is still kept."""
    from bigbatch.config.strategy import Strategy

    out, _ = tiny
    calls = _counting(monkeypatch)
    run_study(StudyConfig(**TINY, out=str(out)))  # as the fixture left it (or rerun so)
    calls.clear()
    real = Strategy.in_force
    monkeypatch.setattr(Strategy, "in_force", lambda self: {
        **real(self), "batch.lr_find_steps": 7 if self.lars.enable else self.lr_find_steps})
    results = run_study(StudyConfig(**TINY, out=str(out)))
    assert sorted(calls) == [("lars-b32", False), ("lars-b64", False)]
    assert [c["status"] for c in results["cells"]] == ["kept", "kept", "ran", "ran"]
    monkeypatch.setattr(Strategy, "in_force", real)
    old = out / "cells" / "sgd-b32" / S.CELL_FILE
    spec = json.loads(old.read_text())
    del spec["in_force"]
    old.write_text(json.dumps(spec))
    calls.clear()
    run_study(StudyConfig(**{**TINY, "strategies": ["sgd"]}, out=str(out)))
    assert calls == []


def test_interrupted_cell_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    cfg = StudyConfig(**{**TINY, "strategies": ["sgd"], "batches": [64]}, out=str(tmp_path))
    calls = _counting(monkeypatch)
    run_study(cfg)
    cell = tmp_path / "cells" / "sgd-b64"
    spec = json.loads((cell / S.CELL_FILE).read_text())
    (cell / S.CELL_FILE).unlink()  # as if killed after its last checkpoint
    (cell / S.PENDING_FILE).write_text(json.dumps(spec))
    results = run_study(cfg)
    assert calls == [("sgd-b64", False), ("sgd-b64", True)] and results["cells"][0]["status"] == "resumed"
    assert results["cells"][0]["steps"] == 800 // 64


def test_steps_to_target_on_synthetic_evals():
    evals = [(10, 0.5), (20, 0.7), (30, 0.9), (40, 0.95)]
    assert steps_to_target(evals, 0.8) == pytest.approx(25.0)  # halfway between 20 and 30
    assert steps_to_target(evals, 0.9) == 30.0
    assert steps_to_target(evals, 0.4) == 10.0  # reached at the first evaluation
    assert steps_to_target(evals, 0.99) is None
    bpc = [(5, 3.0), (10, 2.0), (15, 1.5)]
    assert steps_to_target(bpc, 1.75, higher_is_better=False) == pytest.approx(12.5)
    assert steps_to_target([(5, None), (10, 0.9)], 0.8) == 10.0


def test_mccandlish_fit_recovers_the_model():
    pts = [(b, 100 * (1 + 512 / b)) for b in (64, 256, 1024, 4096)]
    fit = _fit_mccandlish(pts)
    assert fit["s_min"] == pytest.approx(100) and fit["b_noise"] == pytest.approx(512)
    assert _fit_mccandlish(pts[:2]) is None


def _cell(name, batch, final=None, stt=None, steps=100):
    return {"strategy": name, "global_batch_size": batch, "final": final,
            "steps_to_target": stt, "steps": steps}


def test_claims_are_computed_from_the_numbers():
    base = _cell("sgd", 128, 0.99)
    cells = [base, _cell("sgd", 1024, 0.95), _cell("sgd", 4096, 0.80),
             _cell("lars", 128, 0.99), _cell("lars", 1024, 0.988), _cell("lars", 4096, 0.90)]
    claim = claim_accuracy(cells, base, 0.005, True)
    assert claim["verdict"] == "partly held"
    assert "lars@1024" in claim["why"] and "lost it at lars@4096" in claim["why"]
    flat = [_cell("sgd", 128, 0.99), _cell("sgd", 1024, 0.988), _cell("lars", 1024, 0.99)]
    assert claim_accuracy(flat, flat[0], 0.005, True)["verdict"] == "untested"
    # bpc: lower is better.
    lm = [_cell("sgd", 16, 2.0), _cell("sgd", 256, 2.3), _cell("lamb", 256, 2.01)]
    assert claim_accuracy(lm, lm[0], 0.02, False)["verdict"] == "held"

    steps = [_cell("sgd", 64, stt=1000), _cell("sgd", 128, stt=520), _cell("sgd", 256, stt=280),
             _cell("sgd", 512, stt=250), _cell("sgd", 1024, stt=None, steps=240)]
    claim = claim_scaling(steps, 256)
    assert claim["verdict"] == "held"
    pairs = {(p["from"], p["to"]): p for p in claim["pairs"]}
    assert pairs[(64, 128)]["efficiency"] == pytest.approx(1000 / 520 / 2)
    assert pairs[(512, 1024)]["upper_bound"] and pairs[(512, 1024)]["region"] == "above"
    linear = [_cell("sgd", b, stt=64000 / b) for b in (64, 128, 256, 512, 1024)]
    assert claim_scaling(linear, 256)["verdict"] == "partly held"  # never flattens
    assert claim_scaling(linear, None)["verdict"] == "untested"


def _args(*argv):
    parser = argparse.ArgumentParser()
    C.add_study_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--batches", "64,abc"], "--batches='64,abc': 'abc' is not an integer"),
    (["--batches", "64,0"], "--batches='64,0': 0 is out of range"),
    (["--strategies", "sgd,adam"], "--strategies='sgd,adam': 'adam' is not a strategy; valid: "),
    (["--set", "rmsprop:lars.lars_coeff=1"], "--set rmsprop:...: unknown strategy"),
])
def test_bad_flags_give_one_line_errors(argv, message, capsys):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
        C.config_from_args(_args(*argv))
    assert C.run_study_command(_args(*argv, "--out", "/nonexistent/x")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bigbatch study: error: ")


def test_batch_larger_than_training_set_is_a_config_error(tmp_path):
    cfg = StudyConfig(**{**TINY, "batches": [32, 1024]}, out=str(tmp_path))
    with pytest.raises(ConfigError, match="--batches: 1024 is larger than the training set"):
        run_study(cfg)
    assert not (tmp_path / "cells").exists()  # checked before any cell ran


def test_config_file_then_flags(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text('[study]\ntask = "mnist1d"\nbatches = [64, 256]\nepochs = 3\n'
                    '[set]\nlars = ["lars.lars_coeff=0.02"]\nall = ["batch.decay=\\"poly\\""]\n')
    cfg = C.config_from_args(_args("--config", str(path), "--epochs", "5",
                                   "--set", "sgd:optimizer.nesterov=true"))
    assert cfg.batches == [64, 256] and cfg.epochs == 5
    assert cfg.overrides == {"lars": ["lars.lars_coeff=0.02"], "all": ['batch.decay="poly"'],
                             "sgd": ["optimizer.nesterov=true"]}
    path.write_text("[study]\nbatch = [64]\n")
    with pytest.raises(ConfigError, match="unknown key study.batch"):
        C.config_from_args(_args("--config", str(path)))
    quick = C.config_from_args(_args("--quick", "--strategies", "sgd"))
    assert quick.strategies == ["sgd"] and quick.batches == QUICK["mnist1d"]["batches"]


def test_strategies_follow_their_rules():
    from bigbatch.tasks.mnist1d import _RECIPES

    cfg, recipe = StudyConfig(epochs=16, warmup_epochs=2.0), _RECIPES["cnn"]
    sgd = S.cell_strategy(cfg, recipe, "sgd", 1024)
    lars = S.cell_strategy(cfg, recipe, "lars", 1024)
    lamb = S.cell_strategy(cfg, recipe, "lamb", 1024)
    ada = S.cell_strategy(cfg, recipe, "adascale", 1024)
    assert sgd.resolve(1).peak_lr == pytest.approx(0.1 * 8) and sgd.resolve(1).k_steps == 8
    assert lars.lars.enable and lars.resolve(1).peak_lr == pytest.approx(0.8)
    assert lamb.lamb.enable and lamb.resolve(1).peak_lr == pytest.approx(0.01 * 8**0.5)
    assert ada.adaptive.lr == "adascale" and ada.resolve(1).peak_lr == pytest.approx(0.1)
    assert all(s.adaptive.noise_scale for s in (sgd, lars, lamb, ada))
    cfg2 = StudyConfig(nproc=2, micro_batch_size=128)
    assert S.cell_strategy(cfg2, recipe, "sgd", 1024).resolve(2).k_steps == 4
    with pytest.raises(ConfigError, match="not a multiple of micro batch 128 x nproc 2"):
        S.cell_strategy(cfg2, recipe, "sgd", 384)


def test_launched_cells_use_the_train_cli(tmp_path):
    from bigbatch.tasks.mnist1d import _RECIPES

    cfg = StudyConfig(nproc=2, task_options={"num_samples": 1000}, model="cnn", epochs=2)
    s = S.cell_strategy(cfg, _RECIPES["cnn"], "sgd", 64)
    cell = S.Cell("sgd", 64, tmp_path, s, {"task": "mnist1d", "model": "cnn", "epochs": 2,
                                          "seed": 0, "nproc": 2, "eval_every": None,
                                          "task_options": {"num_samples": 1000}})
    cmd = S.train_command(cell, resume=True)
    assert cmd[1:4] == ["-m", "bigbatch", "train"] and cmd[-1] == "--resume"
    assert cmd[cmd.index("--nproc") + 1] == "2"
    assert cmd[cmd.index("--task-opt") + 1] == "num_samples=1000"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_study_end_to_end(tmp_path):
    out = tmp_path / "quick"
    proc = subprocess.run([sys.executable, "-m", "bigbatch.cli.study", "--quick", "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert len(results["cells"]) == 8 and all(c["status"] == "ran" for c in results["cells"])
    assert (out / "steps_to_target.png").is_file()


def test_critical_batch_prefers_well_trained_unbiased_cells():
    base = {"final": 0.99}
    cells = [{"final": 0.99, "noise_scale": 5000.0, "noise_scale_biased": True},
             {"final": 0.985, "noise_scale": 1000.0, "noise_scale_biased": False},
             {"final": 0.98, "noise_scale": 3000.0, "noise_scale_biased": False},
             {"final": 0.20, "noise_scale": 4.0, "noise_scale_biased": False}]  # diverged
    b, source = critical_batch(cells, base, 0.005, True)
    assert b == pytest.approx(2000.0) and source.startswith("well-trained cells, unbiased")
    b, source = critical_batch(cells[:1] + cells[3:], base, 0.005, True)
    assert b == 5000.0 and "biased" in source


def test_noise_curve_is_a_ratio_of_rolling_means():
    from bigbatch.study.plots import smoothed_noise

    # 4 log lines per epoch -> a window of 2 lines.
    series = [[i, i / 4, 0.0, False, tr, g] for i, (tr, g) in
              enumerate([(10, 1), (30, 1), (20, 2), (40, 2)], start=1)]
    xs, ys = smoothed_noise(series)
    assert xs == [0.25, 0.5, 0.75, 1.0]
    assert ys == pytest.approx([10.0, 20.0, 50 / 3, 60 / 4])


def test_a_grid_without_a_small_batch_cell_has_no_baseline(tmp_path, monkeypatch, capsys):
    """sgd and lars at 256 and 512 only (the recipe's batch is 128): no cell is taken for the
    small-batch baseline; the small budget (1 of 16 epochs, 1,000 samples) heads each verdict."""
    monkeypatch.setattr("bigbatch.study.report.plot_all", lambda results, out: {})
    out = tmp_path / "study"
    code = C.main(["--task", "mnist1d", "--model", "mlp", "--task-opt", "num_samples=1000",
                   "--epochs", "1", "--batches", "256,512", "--strategies", "sgd,lars",
                   "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["baseline"] is None and results["target"] is None
    report = (out / "report.md").read_text()
    assert "Baseline:" not in report
    assert ("**No small-batch baseline: the grid has no sgd cell at the recipe's batch 128 or "
            "below") in report
    budget = "(small budget: 1 of the recipe's 16 epochs, 1,000 of 50,000 samples)"
    assert results["budget"] == budget[1:-1]
    accuracy = next(line for line in report.splitlines() if "LARS/LAMB stay" in line)
    assert accuracy.startswith(f"- **UNTESTED {budget}** — ")
    assert "no small-batch baseline" in accuracy
    assert all(c["final"] is not None for c in results["cells"])


def test_baseline_is_the_recipes_optimizer_at_a_small_batch():
    from types import SimpleNamespace

    from bigbatch.study.report import _baseline

    recipe = SimpleNamespace(base_batch_size=128)
    cells = [_cell("sgd", 4096, 0.9), _cell("lars", 64, 0.95), _cell("sgd", 8192, 0.8)]
    assert _baseline(cells, recipe) is None
    cells += [_cell("sgd", 128, 0.99), _cell("sgd", 64, 0.98)]
    assert _baseline(cells, recipe)["global_batch_size"] == 64


def test_default_warmup_shrinks_with_a_short_budget():
    from bigbatch.study.rules import _warmup_epochs
    from bigbatch.tasks.charlm import _RECIPES as LM

    recipe = LM["transformer"]  # 0.25 of 4 epochs
    assert _warmup_epochs(StudyConfig(task="charlm", epochs=4), recipe) == 0.5  # epochs / 8
    assert _warmup_epochs(StudyConfig(task="charlm", epochs=1), recipe) == 0.125
    assert _warmup_epochs(StudyConfig(task="charlm", epochs=0.05), recipe) == 0.05 / 8
    assert _warmup_epochs(StudyConfig(task="charlm", epochs=1, warmup_epochs=0.5), recipe) == 0.5
