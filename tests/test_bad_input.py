"""Bad input to `bigbatch train`: exit code 2, one line naming the problem, no traceback,
and the output directory exactly as it was (here: it holds a previous run).

Runs in-process through `bigbatch.cli.main.main` with `--nproc 1` (no launcher), so the whole
table takes seconds.
"""

import os

import pytest
import torch

from bigbatch.cli.main import main
from tests._cli import snapshot

TINY = ["--nproc", "1", "--no-progress", "--no-tensorboard", "--task-opt", "num_samples=1000",
        "--set", "batch.global_batch_size=64", "--set", "batch.base_batch_size=32",
        "--set", "batch.warmup_epochs=0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A previous run (2 steps, cnn) and a few input files, shared by every case."""
    root = tmp_path_factory.mktemp("bad_input")
    old_cache = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.getbasetemp() / "xdg-cache")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["train", *TINY, "--out", str(root / "prev"), "--steps", "2",
                     "--model", "cnn", "--checkpoint-every", "1"])
    finally:
        torch.set_num_threads(n)
    assert code == 0
    (root / "bad.toml").write_text("[lars\n")
    (root / "unknown_key.toml").write_text("[batch]\nglobal_batch = 64\n")
    (root / "wrong_type.toml").write_text('[batch]\nglobal_batch_size = "big"\n')
    (root / "list.toml").write_text("batch = [1, 2]\n")
    (root / "dir.toml").mkdir()
    (root / "a_file").write_text("not a directory\n")
    (root / "latin1.toml").write_bytes("# stratégie\n[batch]\n".encode("latin-1"))
    (root / "empty").mkdir()
    (root / "empty" / "notes.txt").write_text("keep me\n")
    yield root
    if old_cache is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old_cache


S = "--set"
# (case id, extra argv ({root} is the fixture dir), output dir under root, expected substring)
CASES = [
    # strategy: unknown sections and keys, wrong types, out-of-range values
    ("unknown_section", [S, "foo.bar=1"], "prev", "unknown section [foo]"),
    ("unknown_key", [S, "batch.global_batch=64"], "prev", "global_batch_size"),
    ("unknown_key_lars", [S, "lars.lars_coef=0.1"], "prev", "lars_coeff"),
    ("wrong_type_int", [S, 'batch.global_batch_size="abc"'], "prev", "expected int"),
    ("wrong_type_float", [S, "batch.base_lr=fast"], "prev", "batch.base_lr: expected float"),
    ("wrong_type_bool", [S, "lars.enable=3"], "prev", "lars.enable: expected bool"),
    ("negative_lr", [S, "batch.base_lr=-1"], "prev", "batch.base_lr must be > 0"),
    ("zero_batch", [S, "batch.global_batch_size=0"], "prev", "global_batch_size must be >= 1"),
    ("bad_scaling", [S, "batch.scaling=cubic"], "prev", "batch.scaling must be one of"),
    ("bad_decay", [S, "batch.decay=exp"], "prev", "batch.decay must be one of"),
    ("bad_milestones", [S, "batch.decay=step", S, "batch.decay_milestones=[2.0]"], "prev",
     "decay_milestones"),
    ("negative_warmup", [S, "batch.warmup_steps=-1"], "prev", "warmup_steps must be >= 0"),
    ("warmup_too_long", ["--steps", "2", S, "batch.warmup_steps=50"], "prev",
     "batch.warmup_steps=50 is longer than the run's 2 steps; lower batch.warmup_steps"),
    ("warmup_epochs_too_long", ["--steps", "2", S, "batch.warmup_epochs=1"], "prev",
     "batch.warmup_epochs=1 (12 steps) is longer than the run's 2 steps"),
    ("bad_amp_dtype", [S, "amp.dtype=float8"], "prev", "amp.dtype must be one of"),
    ("timeout_zero", [S, "data_parallel.timeout_s=0"], "prev", "timeout_s must be in (0, 604800]"),
    ("bad_reduce", [S, "data_parallel.reduce=max"], "prev", "data_parallel.reduce"),
    ("bad_adaptive", [S, "adaptive.lr=magic"], "prev", "adaptive.lr must be one of"),
    ("bad_recompute", [S, 'recompute.checkpoints=["nosuch"]'], "prev", "no module named"),
    # batch arithmetic
    ("micro_not_divisor", [S, "batch.micro_batch_size=48"], "prev",
     "global_batch_size=64 is not micro_batch_size 48"),
    # the README's old gradient-merge command: the refusal names the key to add
    ("merge_not_enabled", [S, "batch.micro_batch_size=16"], "prev",
     "to merge 4 micro-steps add --set gradient_merge.k_steps=4 (in a file: [gradient_merge] "
     "k_steps = 4), or set batch.global_batch_size=16"),
    ("merge_inconsistent", [S, "batch.micro_batch_size=16", S, "gradient_merge.k_steps=3"],
     "prev", "x k_steps 3"),
    ("batch_larger_than_data", [S, "batch.global_batch_size=100000"], "prev",
     "larger than the training set"),
    ("world_size_not_divisor", ["--nnodes", "1", S, "batch.global_batch_size=63",
                                S, "batch.micro_batch_size=63", "--nproc", "2"], "prev",
     "world_size 2"),
    # conflicting strategies
    ("lars_and_lamb", [S, "lamb.enable=true"], "prev", "[lars] and [lamb] are both enabled"),
    ("lars_with_adamw", [S, "optimizer.type=adamw"], "prev", "[lars] needs optimizer.type"),
    ("unknown_optimizer", [S, "optimizer.type=adam"], "prev", "optimizer.type must be one of"),
    # --set / --task-opt syntax
    ("set_no_equals", [S, "batch"], "prev", "--set takes section.key=value, got --set 'batch'"),
    ("set_space_not_equals", [S, "batch.global_batch_size", "64"], "prev",
     "--set takes section.key=value, got --set batch.global_batch_size 64 "
     "(write --set batch.global_batch_size=64)"),
    ("set_last_without_value", [S], "prev", "--set takes section.key=value, got --set with"),
    ("set_no_value", [S, "batch.global_batch_size="], "prev", "global_batch_size: expected"),
    ("task_opt_syntax", ["--task-opt", "num_samples"], "prev", "must look like key=value"),
    ("task_opt_unknown", ["--task-opt", "foo=1"], "prev", "task option 'foo' is not"),
    ("task_opt_type", ["--task-opt", "num_samples=abc"], "prev", "num_samples: expected int, got str 'abc'"),
    ("task_opt_range", ["--task-opt", "num_samples=3"], "prev", "num_samples must be in [10, 10000000], got 3"),
    # task, model, flags
    ("unknown_task", ["--task", "imagenet"], "prev", "task='imagenet' is not a built-in task"),
    ("unknown_model", ["--model", "resnet"], "prev", "model='resnet' is not a model"),
    ("task_model_mismatch", ["--task", "charlm", "--model", "cnn"], "prev", "valid: transformer"),
    ("nproc_zero", ["--nproc", "0"], "prev", "--nproc: must be >= 1, got 0"),
    ("nproc_word", ["--nproc", "two"], "prev", "--nproc: expected an integer"),
    ("steps_negative", ["--steps", "-1"], "prev", "--steps: must be >= 1, got -1"),
    ("epochs_zero", ["--epochs", "0"], "prev", "--epochs: must be > 0"),
    ("epochs_nan", ["--epochs", "nan"], "prev", "--epochs: expected a finite number"),
    ("epochs_and_steps", ["--epochs", "1", "--steps", "5"], "prev", "not allowed with argument"),
    ("checkpoint_every_zero", ["--checkpoint-every", "0"], "prev", "--checkpoint-every"),
    ("seed_word", ["--seed", "x"], "prev", "--seed: expected an integer, got 'x'"),
    ("unknown_flag", ["--lr", "0.1"], "prev", "unrecognized arguments: --lr"),
    ("bad_nnodes", ["--nnodes", "x", "--nproc", "2"], "prev", "--nnodes='x'"),
    # files
    ("missing_config", ["--config", "{root}/none.toml"], "prev", "cannot read strategy file"),
    ("config_is_dir", ["--config", "{root}/dir.toml"], "prev", "cannot read strategy file"),
    ("invalid_toml", ["--config", "{root}/bad.toml"], "prev", "invalid TOML"),
    ("config_unknown_key", ["--config", "{root}/unknown_key.toml"], "prev", "global_batch_size"),
    ("config_wrong_type", ["--config", "{root}/wrong_type.toml"], "prev", "expected int"),
    ("config_not_a_table", ["--config", "{root}/list.toml"], "prev", "batch"),
    ("out_is_a_file", [], "a_file", "exists and is not a directory"),
    # resume
    ("resume_without_checkpoint", ["--resume"], "empty", "--resume: no checkpoint in"),
    ("resume_missing_dir", ["--resume"], "missing", "--resume: no checkpoint in"),
    ("resume_other_model", ["--resume", "--model", "mlp", "--steps", "4"], "prev",
     "differ from checkpoint step-000000002.pt: model 'cnn' -> 'mlp'"),
    ("resume_other_task", ["--resume", "--task", "charlm", "--model", "transformer"], "prev",
     "task 'mnist1d' -> 'charlm'"),
    ("resume_other_data", ["--resume", "--task-opt", "num_samples=1200"], "prev",
     "task_options {'num_samples': 1000} -> {'num_samples': 1200}"),
    ("resume_world_size_does_not_split", ["--resume", "--nproc", "3"], "prev",
     "the global batch 64 does not split over 3 workers"),
    ("bad_elastic_mode", ["--resume", S, "batch.elastic=grow"], "prev", "batch.elastic"),
    ("resume_other_batch", ["--resume", S, "batch.global_batch_size=100000"], "prev",
     "batch.global_batch_size 64 -> 100000"),
    # resume with settings the checkpoint was not trained with (nothing written)
    ("resume_momentum", ["--resume", S, "optimizer.momentum=0.0"], "prev",
     "optimizer.momentum 0.9 -> 0.0"),
    ("resume_lars_to_lamb", ["--resume", S, "lars.enable=false", S, "lamb.enable=true",
                             S, "optimizer.type=adamw"], "prev", "lars.enable True -> False"),
    ("resume_seed", ["--resume", "--seed", "5"], "prev", "seed 0 -> 5"),
    ("resume_shorter", ["--resume", "--steps", "1"], "prev",
     "--steps 1 ends before checkpoint step-000000002.pt, taken at step 2"),
    ("resume_and_overwrite", ["--resume", "--overwrite"], "prev", "not allowed with argument"),
    # a fresh run into a run's directory
    ("fresh_into_a_run", [], "prev", "holds a run (finished); continue it with --resume"),
    # ranges: no inf, nan or overflow reaches a worker
    ("seed_huge", ["--seed", "99999999999"], "prev", "--seed: must be in [0, 2**32 - 1]"),
    ("seed_negative", ["--seed", "-1"], "prev", "--seed: must be in [0, 2**32 - 1]"),
    ("timeout_huge", ["--timeout", "1e300"], "prev", "--timeout: must be <= 604800"),
    ("timeout_inf", ["--timeout", "inf"], "prev", "--timeout: expected a finite number"),
    ("timeout_key_huge", [S, "data_parallel.timeout_s=1e300"], "prev",
     "data_parallel.timeout_s must be in (0, 604800], got 1e+300"),
    ("epochs_inf", ["--epochs", "inf"], "prev", "--epochs: expected a finite number"),
    ("epochs_huge", ["--epochs", "1e300"], "prev", "--epochs: must be <= 1e+06"),
    ("steps_huge", ["--steps", "99999999999999"], "prev", "--steps: must be <= 2147483647"),
    ("int_key_huge", [S, "amp.incr_every_n_steps=99999999999999999999"], "prev",
     "amp.incr_every_n_steps=99999999999999999999 is out of range"),
    ("loss_scale_huge", [S, "amp.init_loss_scaling=1e300"], "prev",
     "amp.init_loss_scaling must be in (0, 1e+30], got 1e+300"),
    ("config_not_utf8", ["--config", "{root}/latin1.toml"], "prev",
     "latin1.toml is not UTF-8 text (byte 0xe9"),
    ("out_under_a_file", [], "a_file/run", "a_file is a file, not a directory"),
    # settings a worker would find only after the launch
    ("nccl_on_cpu", [S, 'data_parallel.backend="nccl"'], "prev", "needs CUDA devices"),
    ("sync_bn_on_cpu", ["--nproc", "2", S, "data_parallel.sync_batch_norm=true"], "prev",
     "SyncBatchNorm is GPU-only"),
    ("adasum_with_noise_scale", ["--nproc", "2", S, "data_parallel.reduce=adasum",
                                 S, "adaptive.noise_scale=true"], "prev",
     "cannot be combined with adaptive.noise_scale=true"),
    ("endpoint_no_port", ["--nproc", "2", "--rdzv-endpoint", "localhost"], "prev",
     "expected HOST:PORT"),
    ("endpoint_unresolvable", ["--nproc", "2", "--rdzv-endpoint", "nosuchhost.invalid:29400"],
     "prev", "host nosuchhost.invalid does not resolve"),
]

# Task options, checked by name, type and range before any data is made (charlm and mnist1d).
TASK_CASES = [
    ("charlm_n_head_zero", ["--task", "charlm", "--task-opt", "n_head=0"], "n_head must be >= 1"),
    ("charlm_dropout", ["--task", "charlm", "--task-opt", "dropout=1.5"],
     "dropout must be in [0, 1), got 1.5"),
    ("charlm_dropout_word", ["--task", "charlm", "--task-opt", "dropout=high"],
     "dropout: expected float, got str 'high'"),
    ("charlm_d_model_zero", ["--task", "charlm", "--task-opt", "d_model=0"],
     "d_model must be in [1, 65536], got 0"),
    ("charlm_no_layers", ["--task", "charlm", "--task-opt", "n_layer=-1"],
     "n_layer must be in [1, 1024], got -1"),
    ("charlm_heads_do_not_divide", ["--task", "charlm", "--task-opt", "d_model=10"],
     "d_model=10 must be divisible by n_head=4"),
    ("charlm_seq_len", ["--task", "charlm", "--task-opt", "seq_len=1"],
     "seq_len must be in [2, 65536], got 1"),
    ("mnist1d_seed", ["--task-opt", "seed=-1"], "seed must be in [0, 4294967295], got -1"),
    ("mnist1d_samples_huge", ["--task-opt", "num_samples=1000000000"],
     "num_samples must be in [10, 10000000]"),
    ("mnist1d_cache_dir_type", ["--task-opt", "cache_dir=3"], "cache_dir: expected str"),
]


def test_table_has_enough_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv, out, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(argv, out, message, files, capsys, monkeypatch):
    if "CUDA" in message and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv("XDG_CACHE_HOME", os.environ["XDG_CACHE_HOME"])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    out_dir = files / out
    before = snapshot(out_dir)
    if out == "prev":
        assert "summary.json" in before and any(k.startswith("checkpoints") for k in before)
    capsys.readouterr()
    args = ["train", *TINY, "--out", str(out_dir), *[a.format(root=files) for a in argv]]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert message in err, err
    assert "Traceback" not in err
    assert snapshot(out_dir) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_config(files, capsys):
    cfg = files / "secret.toml"
    cfg.write_text("[batch]\n")
    cfg.chmod(0)
    code = main(["train", *TINY, "--out", str(files / "prev"), "--config", str(cfg)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot read strategy file" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [c[1:] for c in TASK_CASES],
                         ids=[c[0] for c in TASK_CASES])
def test_bad_task_option(argv, message, files, capsys):
    before = snapshot(files / "prev")
    code = main(["train", "--nproc", "1", "--no-progress", "--out", str(files / "prev"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert snapshot(files / "prev") == before


def test_world_size_that_is_no_number(files, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "two")
    before = snapshot(files / "prev")
    code = main(["train", *TINY, "--out", str(files / "prev"), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "environment WORLD_SIZE='two': expected an integer >= 1" in err
    assert snapshot(files / "prev") == before


# `bigbatch study` and `bigbatch gns`: flags and study TOML keys of the wrong type or range,
# and a --json path that cannot be written, are refused before anything runs.
STUDY = ["study", "--task-opt", "num_samples=1000", "--no-progress"]
OTHER_CASES = [
    ("study_target_nan", [*STUDY, "--target", "nan"], "argument --target: expected a finite"),
    ("study_epochs_inf", [*STUDY, "--epochs", "inf"], "argument --epochs: expected a finite"),
    ("study_seed", [*STUDY, "--seed", "-3"], "argument --seed: must be in [0, 2**32 - 1]"),
    ("study_tolerance", [*STUDY, "--tolerance", "-1"], "argument --tolerance: must be >= 0"),
    ("study_key_type", [*STUDY, "--config", "{root}/study_type.toml"],
     "study.epochs: expected float or none, got str 'ten'"),
    ("study_key_list_item", [*STUDY, "--config", "{root}/study_batches.toml"],
     "study.batches: expected list of int or none, got str 'x'"),
    ("study_key_range", [*STUDY, "--config", "{root}/study_nproc.toml"],
     "study.nproc must be in [1, 4096], got 0"),
    ("study_key_nan", [*STUDY, "--config", "{root}/study_nan.toml"],
     "study.target must be a finite number, got nan"),
    ("study_not_a_table", [*STUDY, "--config", "{root}/study_flat.toml"],
     "`study` must be a [study] table"),
    ("study_set_not_a_list", [*STUDY, "--config", "{root}/study_set.toml"],
     "set.lars must be a list of"),
    ("study_not_utf8", [*STUDY, "--config", "{root}/latin1.toml"], "not UTF-8 text"),
    ("gns_json_no_folder", ["gns", "--json", "{root}/nowhere/gns.json"],
     "folder {root}/nowhere does not exist"),
    ("gns_json_is_a_dir", ["gns", "--json", "{root}/empty"], "is a directory"),
    ("gns_seed", ["gns", "--seed", "99999999999"], "argument --seed: must be in [0, 2**32 - 1]"),
    ("gns_epochs_inf", ["gns", "--epochs", "inf"], "argument --epochs: expected a finite"),
    ("gns_steps_zero", ["gns", "--steps", "0"], "argument --steps: must be >= 1"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in OTHER_CASES],
                         ids=[c[0] for c in OTHER_CASES])
def test_bad_input_to_study_and_gns(argv, message, files, capsys, monkeypatch):
    for name, text in (("study_type", 'epochs = "ten"'), ("study_batches", 'batches = [64, "x"]'),
                       ("study_nproc", "nproc = 0"), ("study_nan", "target = nan")):
        (files / f"{name}.toml").write_text(f"[study]\n{text}\n")
    (files / "study_flat.toml").write_text("study = 3\n")
    (files / "study_set.toml").write_text('[set]\nlars = "lars.lars_coeff=0.1"\n')
    monkeypatch.chdir(files)  # a study that ran by mistake would write runs/ here
    before = snapshot(files)
    capsys.readouterr()
    code = main([a.format(root=files) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and message.format(root=files) in err and "Traceback" not in err
    after = snapshot(files)
    assert {k: v for k, v in after.items() if not k.startswith("study_")} == {
        k: v for k, v in before.items() if not k.startswith("study_")}
