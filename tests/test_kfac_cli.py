"""K-FAC through the command line: study cells and one-line errors for bad settings."""

from __future__ import annotations

import json

import pytest

from bigbatch.cli.main import main


def test_study_kfac_cells_scale_the_momentum_recipe():
    from bigbatch.study.config import StudyConfig
    from bigbatch.study.rules import cell_strategy
    from bigbatch.tasks.charlm import _RECIPES as CHARLM
    from bigbatch.tasks.mnist1d import _RECIPES

    s = cell_strategy(StudyConfig(epochs=16), _RECIPES["cnn"], "kfac", 1024)
    assert s.kfac.enable and not s.lars.enable and s.optimizer_name() == "K-FAC + momentum"
    assert s.resolve(1).peak_lr == pytest.approx(0.1 * 8) and s.optimizer.weight_decay == 5e-4
    adam = cell_strategy(StudyConfig(epochs=1), next(iter(CHARLM.values())), "kfac", 64)
    assert adam.kfac.enable and adam.optimizer.type == "momentum"


def test_study_runs_kfac_cells_and_reports_steps_to_target(tmp_path, capsys, train_env):
    code = main(["study", "--strategies", "sgd,lars,kfac", "--batches", "512", "--epochs", "1",
                 "--task-opt", "num_samples=2000", "--threads", "1", "--no-progress",
                 "--target", "0.2", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    cells = {c["strategy"]: c for c in json.loads((tmp_path / "results.json").read_text())["cells"]}
    assert cells["kfac"]["steps"] == 3 and cells["kfac"]["steps_to_target"] is not None
    assert "| kfac | 512 |" in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------- bad input, CLI


CLI = ["--nproc", "1", "--no-progress", "--no-tensorboard", "--task-opt", "num_samples=1000",
       "--steps", "1"]


@pytest.mark.parametrize("sets, message", [
    (["kfac.damping=0"], "kfac.damping must be > 0"),
    (["kfac.damping=-1"], "kfac.damping must be > 0"),
    (["kfac.inv_update_freq=0"], "kfac.inv_update_freq must be >= 1"),
    (["kfac.factor_update_freq=0"], "kfac.factor_update_freq must be >= 1"),
    (['kfac.layers=["Conv3d"]'], "kfac.layers: unknown layer type 'Conv3d'"),
    (["kfac.enable=true", "lars.enable=false", "optimizer.type=adamw"], "[kfac] needs momentum SGD"),
    (["kfac.enable=true", "lars.enable=false", "optimizer.type=adamw", "lamb.enable=true"],
     "[kfac] needs momentum SGD or [lars] inside it; [lamb]"),
    (["kfac.enable=true", "sharding.stage=3"], "[kfac] with [sharding]"),
    (["kfac.enable=true", "pipeline.pp_degree=2"], "[kfac] with [pipeline]"),
    (["kfac.enable=true", "tensor_parallel.tensor_parallel_degree=2"], "[kfac] with tensor parallelism"),
])
def test_bad_input_is_one_line_exit_2(sets, message, tmp_path, capsys, train_env):
    argv = ["train", *CLI, "--out", str(tmp_path / "out")]
    for item in sets:
        argv += ["--set", item]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
