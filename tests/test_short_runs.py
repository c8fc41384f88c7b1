"""Short tries: `--steps N` below the task's default warmup scales the warmup to the run
(one line says so) unless the user set it, when the refusal names the key; the own loop's
`prepare()` says what to pass for `batch.warmup_epochs`."""

import pytest
import torch

from bigbatch.cli.main import main
from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World

# The demo strategy (warmup 2 of 16 epochs) on 800 training samples: 12 steps of 64 an
# epoch, so the default warmup is 24 of the recipe's 192 steps.
SMALL = ["--nproc", "1", "--no-progress", "--no-tensorboard", "--task-opt", "num_samples=1000",
         "--model", "mlp", "--set", "batch.global_batch_size=64"]


def _train(argv, out, capsys):
    code = main(["train", *SMALL, "--out", str(out), *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_default_warmup_is_scaled_to_a_short_run(tmp_path, capsys, train_env):
    code, _, err = _train(["--steps", "10"], tmp_path / "a", capsys)
    assert code == 0, err
    line = ("warmup scaled to the run: 1 of 10 steps (the task's default is 24 of its "
            "recipe's 192; set batch.warmup_steps to choose)")
    assert line in err.splitlines()
    saved = Strategy.from_toml(tmp_path / "a" / "strategy.toml").batch
    assert (saved.warmup_steps, saved.warmup_epochs) == (1, 0.0)
    # ... and a resume that extends it keeps that warmup (the saved strategy's).
    code, _, err = _train(["--steps", "12", "--resume"], tmp_path / "a", capsys)
    assert code == 0, err


def test_a_run_as_long_as_the_recipe_keeps_the_warmup(tmp_path, capsys, train_env):
    from bigbatch.tasks import get_task
    from bigbatch.train.config import TrainConfig
    from bigbatch.train.plan import fit_warmup

    task = get_task("mnist1d", num_samples=1000)
    demo = Strategy.from_toml(task.demo_strategy).with_overrides(["batch.global_batch_size=64"])
    for steps, fitted in ((192, None), (400, None), (96, 12)):
        config = TrainConfig(model="mlp", steps=steps, fit_warmup=True)
        s, note = fit_warmup(config, demo, task, 1)
        assert (note is None) == (fitted is None)
        if fitted is not None:
            assert s.batch.warmup_steps == fitted
    s, _ = fit_warmup(TrainConfig(model="mlp", epochs=1, fit_warmup=True), demo, task, 1)
    assert s.batch.warmup_steps == 2  # 24 x 12 / 192 = 1.5 steps: a small --epochs too
    s, note = fit_warmup(TrainConfig(model="mlp", steps=10), demo, task, 1)  # the user's
    assert s is demo and note is None


@pytest.mark.parametrize("argv, key", [
    (["--set", "batch.warmup_epochs=1"], "batch.warmup_epochs=1 (12 steps)"),
    (["--set", "batch.warmup_steps=30"], "batch.warmup_steps=30"),
])
def test_a_warmup_the_user_set_is_refused_naming_its_key(tmp_path, capsys, train_env, argv, key):
    code, _, err = _train(["--steps", "10", *argv], tmp_path / "b", capsys)
    assert code == 2
    assert err.count("\n") == 1
    assert f"{key} is longer than the run's 10 steps; lower {key.split('=')[0]}" in err
    assert not (tmp_path / "b").exists()


def test_a_warmup_in_the_users_file_is_theirs(tmp_path, capsys, train_env):
    conf = tmp_path / "s.toml"
    conf.write_text("[batch]\nglobal_batch_size = 64\nwarmup_steps = 30\n")
    code, _, err = _train(["--steps", "10", "--config", str(conf)], tmp_path / "c", capsys)
    assert code == 2 and "batch.warmup_steps=30 is longer than the run's 10 steps" in err


def test_charlm_short_try_runs_with_its_warmup_scaled(tmp_path, capsys, train_env):
    code = main(["train", "--task", "charlm", "--steps", "4", "--nproc", "1", "--no-progress",
                 "--no-tensorboard", "--task-opt", "d_model=16", "--task-opt", "n_layer=1",
                 "--task-opt", "seq_len=16", "--out", str(tmp_path / "lm")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "warmup scaled to the run: 1 of 4 steps" in err


def test_own_loop_prepare_names_what_warmup_epochs_needs():
    strategy = Strategy.from_dict({"batch": {"global_batch_size": 64, "warmup_epochs": 2}})
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"pass prepare\(\.\.\., samples_per_epoch=len\("
                       r"train_set\)\) or steps_per_epoch=N, or set batch.warmup_steps"):
        prepare(model, strategy, total_steps=100, world=World())
    run = prepare(model, strategy, total_steps=100, world=World(), samples_per_epoch=640)
    assert run.schedule.warmup_steps == 20  # 2 epochs of 640 // 64 steps
