"""`bigbatch study` with growing batches and seeds: `"<base>@<schedule>"` names and their
cells, samples to target under a batch change, rows over seeds, the "steps saved at
equal quality" headline, and one tiny study with `sgd@seesaw` over two seeds."""

import argparse
import json

import pytest

import bigbatch.cli.study as C
import bigbatch.study.sweep as S
from bigbatch.errors import ConfigError
from bigbatch.study.headline import headline
from bigbatch.study.markdown import table
from bigbatch.study.report import steps_to_target, to_target
from bigbatch.study.rules import cell_strategy
from bigbatch.study.samples import batch_changes, samples_at
from bigbatch.study.schedules import NoGrowth, check_name, dir_name, split_name
from bigbatch.study.seeds import aggregate
from bigbatch.study.sweep import StudyConfig, run_study
from bigbatch.tasks.mnist1d import _RECIPES

BASES = ("sgd", "lars", "lamb", "adascale", "kfac")
CNN = _RECIPES["cnn"]  # momentum SGD at batch 128


pytestmark = pytest.mark.usefixtures("train_env")  # one data cache, no torchrun variables


def _args(*argv):
    parser = argparse.ArgumentParser()
    C.add_study_arguments(parser)
    return parser.parse_args(list(argv))


# ---------------------------------------------------------------- names


def test_names_are_a_base_strategy_and_a_schedule():
    assert split_name("lars@seesaw") == ("lars", "seesaw") and split_name("sgd") == ("sgd", None)
    for good in ("sgd", "lars@adaptive", "lamb@seesaw", "adascale@goodput", "kfac@doubling"):
        assert check_name(good, BASES), good
    for bad in ("adam", "lars@", "lars@linear", "@seesaw", "lars@seesaw@adaptive"):
        assert not check_name(bad, BASES), bad
    assert StudyConfig(strategies=["lars", "lars@adaptive"]).strategies == ["lars", "lars@adaptive"]
    with pytest.raises(ConfigError, match=r"^strategies=\['lars@linear'\]: unknown; valid: sgd, "
                       r"lars, lamb, adascale, kfac, muon, or <strategy>@<schedule> with schedule "
                       r"adaptive, seesaw, goodput, doubling \(e.g. lars@adaptive\)$"):
        StudyConfig(strategies=["sgd", "lars@linear"])
    with pytest.raises(ConfigError, match=r"^--set lars@x:\.\.\.: unknown strategy; valid: all, "):
        StudyConfig(overrides={"lars@x": ["batch.start_batch_size=256"]})
    assert C.parse_strategies("sgd, lars@seesaw") == ["sgd", "lars@seesaw"]
    with pytest.raises(ConfigError, match="'lars@fast' is not a strategy; valid: .*lars@adaptive"):
        C.parse_strategies("sgd,lars@fast")
    # Distinct, filesystem-safe cell directories; seed 0 keeps the one-seed names.
    names = {dir_name(n, 4096, s) for n in ("lars", "lars@adaptive", "lars@seesaw") for s in (0, 1)}
    assert len(names) == 6 and "lars_adaptive-b4096" in names and "lars-b4096-s1" in names
    assert all("@" not in n and "/" not in n for n in names)


def test_seeds_from_the_file_and_the_flags(tmp_path):
    assert StudyConfig().seed_list == [0] and StudyConfig(seed=7).seed_list == [7]
    assert StudyConfig(seeds=[1, 0, 1]).seed_list == [1, 0]
    with pytest.raises(ConfigError, match=r"^study\.seeds is empty"):
        StudyConfig(seeds=[])
    with pytest.raises(ConfigError, match=r"^study\.seed=3 is not in study\.seeds=\[0, 1\]"):
        StudyConfig(seed=3, seeds=[0, 1])
    path = tmp_path / "study.toml"
    path.write_text('[study]\nseeds = [0, 1]\n[set]\n"lars@adaptive" = ["batch.start_batch_size=256"]\n')
    cfg = C.config_from_args(_args("--config", str(path)))
    assert cfg.seed_list == [0, 1] and cfg.overrides == {"lars@adaptive": ["batch.start_batch_size=256"]}
    assert C.config_from_args(_args("--config", str(path), "--seeds", "2,3")).seed_list == [2, 3]
    assert C.config_from_args(_args("--config", str(path), "--seed", "5")).seed_list == [5]
    with pytest.raises(ConfigError, match=r"^--seeds='0,x': 'x' is not a seed"):
        C.config_from_args(_args("--seeds", "0,x"))
    with pytest.raises(ConfigError, match="^--seed 1 and --seeds 0,1 are both given"):
        C.config_from_args(_args("--seed", "1", "--seeds", "0,1"))


# ---------------------------------------------------------------- the cells


def test_each_schedule_grows_from_the_start_to_the_cells_batch():
    cfg = StudyConfig(epochs=16)
    for schedule in ("adaptive", "seesaw"):
        s = cell_strategy(cfg, CNN, f"lars@{schedule}", 1024)
        assert s.lars.enable and s.batch.schedule == schedule
        assert s.batch.start_batch_size == 128 and s.resolve(1).global_batch_size == 128
        assert s.ceiling(1).global_batch_size == 1024
        assert s.ceiling(1).peak_lr == pytest.approx(cell_strategy(cfg, CNN, "lars", 1024)
                                                     .resolve(1).peak_lr)  # the same recipe
    goodput = cell_strategy(cfg, CNN, "sgd@goodput", 2048)
    a = goodput.adaptive
    assert a.batch_size == "goodput" and (a.min_batch_size, a.max_batch_size) == (128, 2048)
    assert goodput.resolve(1).global_batch_size == 128 and goodput.batch.schedule == "fixed"
    doubling = cell_strategy(cfg, CNN, "lamb@doubling", 4096)
    assert doubling.adaptive.policies == ("noise_scale_doubling",) and doubling.lamb.enable
    assert doubling.adaptive.max_batch_size == 4096
    assert doubling.resolve(1).global_batch_size == 128
    assert goodput.adaptive.interval_steps == doubling.adaptive.interval_steps == 10
    pollux = cell_strategy(cfg, CNN, "adascale@goodput", 1024)
    assert pollux.adaptive.lr == "adascale" and pollux.adaptive.goodput


def test_the_start_comes_from_set_and_a_base_strategys_keys_apply_to_its_growing_forms():
    cfg = StudyConfig(epochs=16, overrides={
        "lars": ["batch.base_batch_size=256", "batch.base_lr=0.3125", "lars.lars_coeff=0.001"],
        "lars@adaptive": ["batch.start_batch_size=512"],
        "lars@goodput": ["batch.start_batch_size=512"]})
    seesaw = cell_strategy(cfg, CNN, "lars@seesaw", 4096)  # the recipe's batch, now 256
    assert seesaw.batch.start_batch_size == 256 and seesaw.lars.lars_coeff == 0.001
    assert seesaw.batch.base_lr == 0.3125
    assert cell_strategy(cfg, CNN, "lars@adaptive", 4096).batch.start_batch_size == 512
    goodput = cell_strategy(cfg, CNN, "lars@goodput", 4096)
    assert goodput.adaptive.min_batch_size == 512 and goodput.resolve(1).global_batch_size == 512
    with pytest.raises(NoGrowth, match="lars@adaptive at batch 512: its start batch 512 is not "
                       "below it"):
        cell_strategy(cfg, CNN, "lars@adaptive", 512)
    with pytest.raises(ConfigError, match=r"^strategy adascale@seesaw at batch 1024: "
                       r"batch\.schedule=\"seesaw\" with adaptive\.lr=\"adascale\""):
        cell_strategy(StudyConfig(), CNN, "adascale@seesaw", 1024)
    bad = StudyConfig(overrides={"sgd@seesaw": ["batch.start_batch_size=big"]})
    with pytest.raises(ConfigError, match=r"^--set sgd@seesaw:batch\.start_batch_size=big: "):
        cell_strategy(bad, CNN, "sgd@seesaw", 1024)


# ---------------------------------------------------------------- the numbers


def test_samples_to_target_count_each_step_at_its_batch():
    # 10 steps at 64, then 128 from step 11 (the change logged at step 10), 256 from 21.
    lines = [{"kind": "train", "step": 5}, {"kind": "batch_size", "step": 10, "old": 64, "new": 128},
             {"kind": "batch_size", "step": 20, "old": 128, "new": 256},
             {"kind": "batch_size", "step": 10, "old": 64, "new": 128}]  # written again on resume
    changes = batch_changes(lines)
    assert changes == [(10, 64, 128), (20, 128, 256)]
    assert samples_at([0, 5, 10, 15, 20, 30], 64, changes) == [0, 320, 640, 1280, 1920, 4480]
    assert samples_at([12.5], 64, changes) == [640 + 2.5 * 128]
    rec = {"evals": [[10, 0.1, 0.5], [20, 0.2, 0.7], [30, 0.4, 0.9]], "samples": 4480,
           "epochs": 0.4, "eval_samples": samples_at([10, 20, 30], 64, changes)}
    to_target(rec, 0.8, True)
    # Halfway between the evaluations at 20 and 30 steps: in steps and in samples.
    assert rec["steps_to_target"] == pytest.approx(25.0)
    assert rec["samples_to_target"] == pytest.approx((1920 + 4480) / 2)
    assert rec["average_batch_to_target"] == pytest.approx(3200 / 25)
    assert rec["epochs_to_target"] == pytest.approx(3200 / (4480 / 0.4))
    # A fixed batch: samples are steps x batch, so both interpolations agree.
    fixed = [(s, v) for s, _, v in rec["evals"]]
    points = [(n, v) for n, (_, v) in zip(samples_at([10, 20, 30], 64, []), fixed, strict=True)]
    assert steps_to_target(points, 0.8) == pytest.approx(64 * steps_to_target(fixed, 0.8))


def _cell(name, batch, seed, final, stt=None, samples=None, steps=100, wall=10.0):
    return {"strategy": name, "global_batch_size": batch, "seed": seed, "status": "ran",
            "final": final, "steps": steps, "epochs": 4.0, "samples": steps * batch,
            "average_batch": float(batch), "wall_time_s": wall, "peak_lr": 0.1,
            "steps_to_target": stt, "samples_to_target": samples,
            "schedule": name.partition("@")[2] or None,
            "start_batch_size": 128 if "@" in name else None}


def test_rows_average_over_seeds_and_need_every_seed_for_a_mean_to_target():
    cells = [_cell("sgd", 128, 0, 0.98, 400, 51200), _cell("sgd", 128, 1, 0.99, 600, 76800),
             _cell("sgd", 1024, 0, 0.97, 90, 92160), _cell("sgd", 1024, 1, 0.90, None),
             {"strategy": "lars", "global_batch_size": 128, "seed": 0, "status": "failed"}]
    small, big, failed = aggregate(cells)
    assert small["seeds"] == [0, 1] and small["finished"] == 2 and small["reached"] == 2
    assert small["final"] == pytest.approx(0.985)
    assert small["spread"]["final"]["std"] == pytest.approx(0.0070710678)  # sample std (n - 1)
    assert small["steps_to_target"] == 500 and small["spread"]["steps_to_target"]["min"] == 400
    assert small["by_seed"]["1"]["steps_to_target"] == 600
    assert big["reached"] == 1 and big["steps_to_target"] is None  # not a mean of the lucky seed
    assert big["spread"]["steps_to_target"]["mean"] == 90
    assert failed["final"] is None and failed["status"] == "failed"
    text = table({"metric": "accuracy", "target": 0.95, "baseline": small,
                  "rows": [small, big, failed], "cells": cells})
    assert "| sgd | 128 | 4 | 98.50% ± 0.71 | +0.00 pt | 100 ± 0 | 500 ± 141 | 64000 ± 18102 |" in text
    assert "| 1 of 2 seeds: 90 |" in text and "| lars | 128 | failed |" in text


def test_headline_steps_saved_against_the_baseline_and_the_best_fixed_batch():
    cells = [_cell("sgd", 128, 0, 0.990, 1000, 128000), _cell("sgd", 128, 1, 0.992, 1200, 153600),
             _cell("lars", 128, 0, 0.990, 900), _cell("lars", 128, 1, 0.990, 1100),
             _cell("lars", 1024, 0, 0.989, 300), _cell("lars", 1024, 1, 0.985, 500),
             _cell("lars", 4096, 0, 0.95, 200), _cell("lars", 4096, 1, 0.95, None),
             _cell("lars@adaptive", 4096, 0, 0.990, 250, 160000),
             _cell("lars@adaptive", 4096, 1, 0.989, 300, 192000),
             _cell("lars@seesaw", 4096, 0, 0.97, 700), _cell("lars@seesaw", 4096, 1, 0.96, None),
             _cell("adascale", 1024, 0, 0.991, 500), _cell("adascale", 1024, 1, 0.991, 600)]
    rows = aggregate(cells)
    base = rows[0]
    adaptive, seesaw, ada = headline(rows, base, 0.005, True)
    # Per seed against the same seed: 1 - 250/1000 and 1 - 300/1200, both 0.75.
    assert adaptive["vs_baseline"]["saved"]["mean"] == pytest.approx(0.75)
    assert adaptive["vs_baseline"]["saved"]["std"] == pytest.approx(0.0)
    assert adaptive["vs_baseline"]["samples_ratio"] == pytest.approx(176000 / 140800)
    # The best fixed LARS that reached the target in every seed: 1024 (4096 missed in one).
    best = adaptive["vs_best_fixed"]
    assert (best["strategy"], best["global_batch_size"]) == ("lars", 1024)
    assert best["saved"]["mean"] == pytest.approx(((1 - 250 / 300) + (1 - 300 / 500)) / 2)
    assert adaptive["keeps_quality"] and adaptive["final_loss"] == pytest.approx(0.0015)
    assert seesaw["vs_baseline"]["saved"] is None and not seesaw["keeps_quality"]
    assert seesaw["vs_baseline"]["why"] == "target reached in 1 of 2 seeds"
    assert adaptive["steps_to_target"] == 275 and adaptive["steps_to_target_std"] > 0
    # AdaScale scales the recipe's optimizer: its best fixed batch is sgd's.
    assert ada["vs_best_fixed"]["strategy"] == "sgd"
    assert ada["vs_baseline"]["saved"]["mean"] == pytest.approx(0.5)
    assert [h["strategy"] for h in headline(rows, None, 0.005, True)] == [
        "lars@adaptive", "lars@seesaw", "adascale"]
    assert headline(rows, None, 0.005, True)[0]["vs_baseline"]["saved"] is None


# ---------------------------------------------------------------- end to end


def test_tiny_seesaw_study_over_two_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr("bigbatch.study.report.plot_all", lambda results, out: {})
    cfg = StudyConfig(task="mnist1d", model="mlp", task_options={"num_samples": 1000}, epochs=2,
                      batches=[32, 128], strategies=["sgd", "sgd@seesaw"], micro_batch_size=32,
                      seeds=[0, 1], overrides={"sgd@seesaw": ["batch.start_batch_size=32"]},
                      progress=False, out=str(tmp_path))
    results = run_study(cfg)
    cells = {(c["strategy"], c["global_batch_size"], c["seed"]): c for c in results["cells"]}
    assert sorted(cells) == [("sgd", 32, 0), ("sgd", 32, 1), ("sgd", 128, 0), ("sgd", 128, 1),
                             ("sgd@seesaw", 128, 0), ("sgd@seesaw", 128, 1)]
    assert results["skipped"] == ["sgd@seesaw at batch 32: its start batch 32 is not below it; a "
                                  "growing batch needs a ceiling above its start"]
    for c in cells.values():
        assert c["status"] == "ran" and 1500 < c["samples"] <= 1600  # 2 epochs of 800 samples
        assert c["eval_samples"][-1] == c["samples"]  # exact from the batch changes
    grown = cells[("sgd@seesaw", 128, 0)]
    assert grown["start_batch_size"] == 32 and grown["batch_changes"]
    assert grown["batch_changes"][-1][2] == 128 and 32 < grown["average_batch"] < 128
    assert (tmp_path / "cells" / "sgd_seesaw-b128-s1" / "summary.json").is_file()
    row = next(r for r in results["rows"] if r["strategy"] == "sgd@seesaw")
    assert row["seeds"] == [0, 1] and row["spread"]["final"]["n"] == 2
    assert [h["strategy"] for h in results["headline"]] == ["sgd@seesaw"]
    report = (tmp_path / "report.md").read_text()
    assert "## Steps saved at equal quality" in report and "| sgd@seesaw | 32→128 |" in report
    assert "seeds 0, 1 (each number: mean ± sample standard deviation over them)" in report
    assert json.loads((tmp_path / "results.json").read_text())["seeds"] == [0, 1]
    # A restart keeps every finished cell of every seed.
    calls = []
    monkeypatch.setattr(S, "_run_in_process", lambda cell, resume, threads=None: calls.append(1))
    assert {c["status"] for c in run_study(cfg)["cells"]} == {"kept"} and calls == []
