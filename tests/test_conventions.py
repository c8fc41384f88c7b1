"""Output conventions and guards of the command line: the result line on stdout and the
rest on stderr, whole step counts and tidy epochs, `scripts/test --help`, and the one-line
warnings for settings that waste the machine (more workers than cores, fp16 on a CPU)."""

import subprocess

from bigbatch.train.progress import count, tidy
from tests._cli import ROOT, run_cli

# 800 training samples, 64 a step: 12 steps an epoch; 15 steps end at 1.25 epochs.
SMALL = ["--task-opt", "num_samples=1000", "--model", "mlp", "--set",
         "batch.global_batch_size=64", "--set", "batch.base_batch_size=32", "--set",
         "batch.warmup_epochs=0", "--no-tensorboard", "--nproc", "1"]


def test_result_on_stdout_progress_on_stderr(tmp_path, tmp_path_factory):
    p = run_cli(["train", *SMALL, "--steps", "15", "--log-every", "5", "--out",
                 str(tmp_path / "run")], tmp_path_factory.getbasetemp() / "xdg-cache")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("test accuracy ") and p.stdout.count("\n") == 1
    assert " after 1.25 epochs in 15 steps at global batch 64 " in p.stdout
    assert "test accuracy" not in p.stderr
    steps = [line.split()[1] for line in p.stderr.splitlines() if line.startswith("step ")]
    assert steps == ["5/15", "10/15", "15/15"]


def test_counts_print_as_people_write_them():
    assert [count(1.0), count(144), count(2.5)] == ["1", "144", "2.50"]
    assert [tidy(2.2222222), tidy(16.0), tidy(0.5), tidy(0.392157)] == ["2.22", "16", "0.5",
                                                                       "0.39"]


def test_scripts_test_help_is_its_own_short_usage():
    p = subprocess.run([str(ROOT / "scripts" / "test"), "--help"], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.startswith("usage: scripts/test [--slow]")
    assert len(p.stdout.splitlines()) < 20 and "pytest --help" in p.stdout


def test_more_workers_than_cores_is_one_warning_line(tmp_path, capsys, monkeypatch, train_env):
    """`--nproc 64` on this machine: one line after the checks, then the launch goes on (here
    a stand-in for torchrun, which would start 64 workers)."""
    import os

    from bigbatch.cli.main import main

    launched = []
    monkeypatch.setattr("bigbatch.cli.launch.run_torchrun",
                        lambda argv, **kw: launched.append(argv) or 0)
    cores = len(os.sched_getaffinity(0))
    code = main(["train", *SMALL[:-2], "--nproc", "64", "--steps", "2", "--no-progress",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0 and launched, err
    assert err == (f"bigbatch train: warning: --nproc 64 starts 64 workers on {cores} CPU cores: "
                   f"they take turns on them, and every step is slower than with --nproc "
                   f"{cores} (--nproc auto)\n")


def test_fp16_on_a_cpu_is_one_warning_line(tmp_path, capsys, train_env):
    from bigbatch.cli.main import main

    code = main(["train", *SMALL, "--set", "amp.dtype=float16", "--steps", "1",
                 "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == ["bigbatch train: warning: amp.dtype=float16 on a CPU runs about 10x "
                        "slower than bfloat16 (CPUs have no fast float16 kernels): --set "
                        "amp.dtype=bfloat16"]


def test_checkpoint_note_says_what_there_is_to_resume(tmp_path):
    from bigbatch.train.signals import checkpoint_note

    assert checkpoint_note(tmp_path) == ("no checkpoint was written: a new run starts from "
                                         "the beginning")
