"""`bigbatch train`: outputs, exact resume (1 and 2 workers), bad input exits 2."""

import json

import pytest
import torch

import bigbatch.train.trainer as T
from bigbatch.cli.main import build_parser, main
from bigbatch.cli.train import _strip_launch_flags, _torchrun_argv, resolve
from bigbatch.config.strategy import Strategy
from bigbatch.tasks import get_task
from bigbatch.train.trainer import TrainConfig, train
from tests._dist import run_workers

SMALL = {"num_samples": 1000}  # 800 train / 200 test samples
STRATEGY = """
[batch]
global_batch_size = 64
base_batch_size = 32
base_lr = 0.05
warmup_steps = 2
decay = "cosine"

[optimizer]
type = "momentum"
weight_decay = 0.0

[lars]
lars_coeff = 0.01
exclude_from_weight_decay = ["bn", "bias"]
"""


pytestmark = pytest.mark.usefixtures("train_env")


def _config(out, **kw):
    base = dict(task="mnist1d", model="cnn", task_options=SMALL, steps=20, out=str(out),
                checkpoint_every=5, log_every=2, progress=False, tensorboard=False)
    return TrainConfig(**{**base, **kw})


class _Crash(Exception):
    pass


def _train_with_crash(config, strategy_text, crash_at_call):
    """Train, dying (on every worker) at the `crash_at_call`-th checkpoint attempt."""
    calls = []
    original = T.rng_state

    def rng_state():
        calls.append(1)
        if len(calls) == crash_at_call:
            raise _Crash
        return original()

    T.rng_state = rng_state
    try:
        train(config, Strategy.from_toml(strategy_text))
    except _Crash:
        return "crashed"
    finally:
        T.rng_state = original
    return "finished"


def _full_crash_resume(full, cut, strategy_text, crash_at_call):
    """In each worker: an uninterrupted run, the same run crashing, then its resume."""
    import tests.test_train as me

    steps = [train(full, Strategy.from_toml(strategy_text))["steps"]]
    steps.append(me._train_with_crash(cut, strategy_text, crash_at_call))
    cut = TrainConfig(**{**cut.to_dict(), "resume": True})
    steps.append(train(cut, Strategy.from_toml(strategy_text))["steps"])
    return steps


def _final(out):
    return torch.load(out / "final.pt", weights_only=True)


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _train_lines(out):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


def test_outputs_and_resume_equals_uninterrupted(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    summary = train(_config(full, tensorboard=None), Strategy.from_toml(STRATEGY))

    s = json.loads((full / "summary.json").read_text())
    for key in ("test_accuracy", "test_loss", "steps", "epochs", "samples", "global_batch_size",
                "world_size", "wall_time_s", "strategy"):
        assert key in s, key
    assert s == json.loads(json.dumps(summary))
    assert s["steps"] == 20 and s["samples"] == 20 * 64 and s["world_size"] == 1
    assert s["epochs"] == pytest.approx(20 / 12)  # 800 // 64 = 12 steps per epoch
    assert s["strategy"]["lars"]["lars_coeff"] == 0.01
    assert Strategy.from_toml(full / "strategy.toml") == Strategy.from_toml(STRATEGY)
    lines = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert [x["step"] for x in train_lines] == list(range(2, 21, 2))
    for key in ("epoch", "lr", "loss", "samples_per_s", "loss_scale", "trust_ratio_min",
                "trust_ratio_median", "trust_ratio_max"):
        assert key in train_lines[0], key
    assert [x["step"] for x in evals] == [12, 20]  # epoch end, and the end
    assert 0 <= evals[-1]["accuracy"] <= 1 and evals[-1]["accuracy"] == s["test_accuracy"]
    model = get_task("mnist1d", **SMALL).build_model("cnn")
    model.load_state_dict(_final(full))
    assert list((full / "tensorboard").glob("events.out.tfevents.*"))

    # The same run, killed at its fourth checkpoint (step 15; 5, 10 and the epoch end 12
    # were written) ...
    assert _train_with_crash(_config(cut), STRATEGY, crash_at_call=4) == "crashed"
    steps = sorted(int(p.stem[5:]) for p in (cut / "checkpoints").glob("step-*.pt"))
    assert steps == [10, 12]
    assert max(x["step"] for x in _train_lines(cut)) == 14  # progress past the checkpoint
    # ... and resumed: the same weights, and metrics.jsonl reads as one run.
    train(_config(cut, resume=True), Strategy.from_toml(STRATEGY))
    _assert_same_weights(_final(full), _final(cut))
    assert [x["loss"] for x in _train_lines(cut)] == [x["loss"] for x in train_lines]


def test_two_workers_resume_equals_uninterrupted(tmp_path):
    get_task("mnist1d", **SMALL)  # fill the cache before the workers start
    full, cut = tmp_path / "full", tmp_path / "cut"
    # Killed at step 12's checkpoint (the third): resumes mid-epoch from step 10.
    got = run_workers(_full_crash_resume, 2, (_config(full), _config(cut), STRATEGY, 3),
                      timeout=150, init_group=True)
    assert got == [[20, "crashed", 20]] * 2
    s = json.loads((full / "summary.json").read_text())
    assert s["world_size"] == 2 and s["micro_batch_size"] == 32
    _assert_same_weights(_final(full), _final(cut))


# ------------------------------------------------------------------ CLI


def _run_cli(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "/nonexistent/s.toml"], "cannot read strategy file"),
        (["--task", "imagenet"], "task='imagenet' is not a built-in task; valid: mnist1d, charlm"),
        (["--model", "resnet"], "model='resnet' is not a model of task 'mnist1d'"),
        (["--task", "charlm", "--model", "cnn"], "valid: transformer"),
        (["--nproc", "0"], "--nproc: must be >= 1, got 0"),
        (["--nproc", "two"], "--nproc: expected an integer"),
        (["--epochs", "2", "--steps", "5"], "not allowed with argument"),
        (["--set", "lars.lars_coef=0.1"], "lars_coeff"),
        (["--set", "nonsense"], "section.key=value"),
        (["--task-opt", "num_sample=5"], "num_samples"),
        (["--resume"], "--resume: no checkpoint in"),
        (["--unknown-flag"], "unrecognized arguments"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    code, err = _run_cli(["train", "--out", str(tmp_path / "o"), "--no-progress", *argv], capsys)
    assert code == 2
    assert err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


def test_bad_config_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[lars\n")
    code, err = _run_cli(["train", "--config", str(bad), "--out", str(tmp_path)], capsys)
    assert code == 2 and "invalid TOML" in err and err.count("\n") == 1
    bad.write_text("[batch]\nglobal_batch_size = 100000\n")
    code, err = _run_cli(["train", "--config", str(bad), "--out", str(tmp_path), "--task-opt",
                          "num_samples=1000", "--no-progress", "--steps", "1"], capsys)
    assert code == 2 and "larger than the training set" in err and err.count("\n") == 1


def test_cli_trains_and_resume_takes_saved_settings(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--nproc", "1", "--out", str(out), "--task-opt", "num_samples=1000",
            "--steps", "3",
            "--set", "batch.global_batch_size=64", "--set", "batch.base_batch_size=32",
            "--set", "batch.warmup_epochs=0",
            "--model", "mlp", "--seed", "3", "--no-progress", "--no-tensorboard"]
    assert main(args) == 0
    s = json.loads((out / "summary.json").read_text())
    assert (s["model"], s["steps"], s["global_batch_size"], s["seed"]) == ("mlp", 3, 64, 3)
    assert s["optimizer"] == "LARS"  # the task's demo strategy
    capsys.readouterr()
    # --resume with a longer --steps: everything else comes from the saved run.
    assert main(["train", "--nproc", "1", "--out", str(out), "--resume", "--steps", "5",
                 "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert (s["model"], s["steps"], s["global_batch_size"], s["seed"]) == ("mlp", 5, 64, 3)
    assert "resuming" in capsys.readouterr().err


def test_launcher_command_passes_torchrun_flags_through():
    argv = ["train", "--nproc", "4", "--nnodes=2", "--rdzv-endpoint", "host:29400",
            "--max-restarts", "3", "--epochs", "2", "--set", "amp.dtype=bfloat16"]
    args = build_parser().parse_args(argv)
    cmd = _torchrun_argv(args, argv, 300.0)  # torchrun's own flags, run in this process
    tail = cmd[cmd.index("-m"):]
    head = cmd[:len(cmd) - len(tail)]
    assert head[:2] == ["--nproc-per-node", "4"] and "--standalone" not in head
    for pair in (["--nnodes", "2"], ["--rdzv-endpoint", "host:29400"], ["--max-restarts", "3"],
                 ["--rdzv-backend", "c10d"], ["--rdzv-conf", "join_timeout=300,read_timeout=300"]):
        i = head.index(pair[0])
        assert head[i : i + 2] == pair
    assert tail == ["-m", "bigbatch", "train", "--epochs", "2", "--set", "amp.dtype=bfloat16"]
    single = build_parser().parse_args(["train", "--nproc", "2"])
    assert "--standalone" in _torchrun_argv(single, ["train", "--nproc", "2"], 300.0)
    assert _strip_launch_flags(["train", "--nproc=2", "--seed", "1"]) == ["train", "--seed", "1"]


def test_default_run_is_the_lars_demo():
    args = build_parser().parse_args(["train"])
    config, strategy = resolve(args)
    assert (config.task, config.model, config.out) == ("mnist1d", None, "runs/train")
    assert strategy.optimizer_name() == "LARS"
    assert strategy.resolve(2).global_batch_size == 4096


MLP_STRATEGY = """
[batch]
global_batch_size = 64
micro_batch_size = 32
base_batch_size = 64
base_lr = 0.05
decay = "cosine"

[optimizer]
type = "momentum"
weight_decay = 0.0005
"""


def _summary(config, strategy_text):
    return train(config, Strategy.from_toml(strategy_text))


def test_two_workers_equal_one_worker_with_gradient_merge(tmp_path):
    # The sampler hands out the same global batches on any world size, so 2 workers x 32
    # and 1 worker x 2 merged micro-steps of 32 take the same steps (MLP: no BatchNorm).
    get_task("mnist1d", **SMALL)
    kw = dict(model="mlp", steps=8, checkpoint_every=100)
    merged = Strategy.from_toml(MLP_STRATEGY).with_overrides(["gradient_merge.enable=true"])
    one = train(_config(tmp_path / "one", **kw), merged)
    two, _ = run_workers(_summary, 2,
                              (_config(tmp_path / "two", **kw), MLP_STRATEGY), timeout=120)
    assert (one["k_steps"], one["world_size"], two["k_steps"], two["world_size"]) == (2, 1, 1, 2)
    a, b = _final(tmp_path / "one"), _final(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert one["test_loss"] == pytest.approx(two["test_loss"], rel=1e-5)


def test_closing_line_names_the_small_batch_baseline():
    from bigbatch.train.progress import closing_line, reference

    recipe = get_task("mnist1d", **SMALL).recipe("cnn")
    s = {"metric": "accuracy", "test_accuracy": 0.99, "epochs": 16.0, "global_batch_size": 4096,
         "optimizer": "LARS", "world_size": 2, "wall_time_s": 40.0, "steps": 144,
         "samples": 589824, "reference": reference(recipe, 16.0, "accuracy")}
    line = closing_line(s)
    assert ("test accuracy 99.00% after 16 epochs in 144 steps at global batch 4096 (LARS, 2 "
            "worker(s)") in line
    assert ("small-batch baseline: 99.31% at batch 128 (momentum, same epochs, about 4608 "
            "steps)") in line
    grew = closing_line({**s, "steps": 521, "batch_size_changes": [{"old": 512, "new": 1024}]})
    assert "in 521 steps at global batch 512 -> 4096 (LARS" in grew  # what it traded
    assert reference(recipe, 8.0, "accuracy") is None
    assert "no small-batch baseline" in closing_line({**s, "reference": None})
    ps = {**s, "world_size": 3, "parameter_server": {"servers": 1, "workers": 2}}
    assert "(LARS, 1 server(s) + 2 worker(s), 40 s)" in closing_line(ps)


def test_other_commands_are_dispatched(capsys):
    assert main(["study", "--batches", "x"]) == 2
    assert "bigbatch study: error: --batches='x'" in capsys.readouterr().err
    assert main(["gns", "--nproc", "0"]) == 2
    assert "bigbatch gns: error: argument --nproc: must be >= 1, got 0" in capsys.readouterr().err
    assert main([]) == 2 and "train" in capsys.readouterr().err


def test_eval_every_and_keep_checkpoints_flags(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--out", str(out), "--task-opt", "num_samples=1000",
                 "--steps", "8", "--model", "mlp", "--set", "batch.global_batch_size=64",
                 "--set", "batch.warmup_epochs=0",
                 "--eval-every", "3", "--checkpoint-every", "1", "--keep-checkpoints", "3",
                 "--no-progress", "--no-tensorboard"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "eval"] == [3, 6, 8]
    assert sorted(p.name for p in (out / "checkpoints").glob("*.pt")) == [
        "step-000000006.pt", "step-000000007.pt", "step-000000008.pt"]
