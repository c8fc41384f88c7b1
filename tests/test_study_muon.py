"""The study's `muon` strategy: Muon for hidden matrices, AdamW for the rest, at AdamW's LR
(Moonlight's update-RMS rule) with square-root scaling; a tiny charlm cell trains through
`bigbatch study`, with the range test and with a Seesaw-grown batch."""

from __future__ import annotations

import json

import pytest

from bigbatch.cli.main import main
from bigbatch.study.config import StudyConfig
from bigbatch.study.rules import MUON_DEFAULT, RULES, STRATEGIES, cell_strategy
from bigbatch.tasks.charlm import _RECIPES as CHARLM
from bigbatch.tasks.mnist1d import _RECIPES as MNIST1D

ADAMW = CHARLM["transformer"]  # AdamW, batch 16, lr 2e-3, weight decay 0.01


def test_muon_cells_carry_the_adamw_recipe_over():
    assert "muon" in STRATEGIES and "Muon" in RULES["muon"]
    s = cell_strategy(StudyConfig(task="charlm", epochs=4), ADAMW, "muon", 64)
    assert s.optimizer_name() == "Muon" and not (s.lamb.enable or s.lars.enable)
    # [muon] owns the weight decay (the recipe's), AdamW's own stays 0 (compat table).
    assert s.optimizer.type == "adamw" and s.optimizer.weight_decay == 0.0
    assert s.muon.muon_weight_decay == ADAMW.weight_decay and s.muon.scale_rule == "adamw"
    assert s.batch.scaling == "sqrt" and s.resolve(1).peak_lr == pytest.approx(2e-3 * 2)
    # A momentum-SGD recipe's LR means nothing to AdamW: torch's AdamW defaults instead.
    m = cell_strategy(StudyConfig(epochs=16), MNIST1D["cnn"], "muon", 512)
    assert m.batch.base_lr == MUON_DEFAULT["base_lr"] and m.optimizer.type == "adamw"
    assert m.muon.muon_weight_decay == MUON_DEFAULT["weight_decay"]
    grown = cell_strategy(StudyConfig(task="charlm", epochs=4), ADAMW, "muon@seesaw", 64)
    assert grown.muon.enable and grown.batch.schedule == "seesaw"
    assert grown.batch.start_batch_size == 16
    found = StudyConfig(task="charlm", epochs=4, lr_find=True, lr_find_above_base=True)
    assert not cell_strategy(found, ADAMW, "muon", 16).batch.lr_find  # the recipe's batch
    assert cell_strategy(found, ADAMW, "muon", 64).batch.lr_find
    assert cell_strategy(StudyConfig(lr_find=True), ADAMW, "muon", 16).batch.lr_find
    over = StudyConfig(task="charlm", epochs=4, overrides={"muon": ["muon.ns_steps=3"]})
    assert cell_strategy(over, ADAMW, "muon", 64).muon.ns_steps == 3


def test_study_trains_tiny_muon_cells(tmp_path, capsys, train_env):
    code = main(["study", "--task", "charlm", "--strategies", "sgd,muon,muon@seesaw",
                 "--batches", "8,32", "--epochs", "1", "--micro-batch", "32", "--lr-find",
                 "--task-opt", "corpus_chars=6000", "--task-opt", "d_model=16",
                 "--task-opt", "n_layer=1", "--task-opt", "seq_len=16", "--task-opt", "n_head=2",
                 "--set", "batch.base_batch_size=8", "--set", "batch.lr_find_steps=6",
                 "--threads", "1", "--no-progress", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    cells = {(c["strategy"], c["global_batch_size"]): c
             for c in json.loads((tmp_path / "results.json").read_text())["cells"]}
    assert {("muon", 8), ("muon", 32), ("muon@seesaw", 32)} <= set(cells)
    for key in (("muon", 32), ("muon@seesaw", 32)):
        cell = cells[key]
        assert cell["optimizer"] == "Muon" and cell["steps"] > 0
        assert 0 < cell["final"] < 8  # finite bits per character, below a uniform guess's
    assert cells[("muon", 32)]["peak_lr"] != cells[("muon", 8)]["peak_lr"]  # found per batch
    assert (tmp_path / "cells" / "muon-b32" / "lr_find.json").is_file()
    assert "| muon | 32 |" in (tmp_path / "report.md").read_text()
