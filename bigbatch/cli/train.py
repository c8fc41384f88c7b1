"""`bigbatch train`: its flags, the TrainConfig and Strategy they make (a resume fills in
what is not given), and the launch of N workers through torchrun's own launcher
(`bigbatch.cli.launch`), after every check (`bigbatch.cli.preflight`) and under the
output directory's lock."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bigbatch.cli.argtypes import EXIT_USAGE, task_options
from bigbatch.cli.argtypes import epochs as _epochs
from bigbatch.cli.argtypes import nonneg_int as _nonneg_int
from bigbatch.cli.argtypes import positive_int as _positive_int
from bigbatch.cli.argtypes import seed as _seed
from bigbatch.cli.argtypes import timeout as _timeout
from bigbatch.cli.preflight import preflight, wasteful_settings
from bigbatch.errors import ConfigError

__all__ = ["EXIT_USAGE", "add_train_arguments", "default_nproc", "resolve", "run_train_command"]

TRAIN_HELP = "train a built-in task under a Strategy"
TRAIN_DESCRIPTION = ("Train a built-in task with a large-batch Strategy. With no arguments: the "
                     "task's demo (LARS at global batch 4096 on MNIST-1D) and its small-batch "
                     "baseline.")

# torchrun flags we pass through unchanged: our flag -> torchrun's flag.
LAUNCHER_FLAGS = {
    "--nnodes": "--nnodes",
    "--node-rank": "--node-rank",
    "--rdzv-endpoint": "--rdzv-endpoint",
    "--rdzv-backend": "--rdzv-backend",
    "--rdzv-id": "--rdzv-id",
    "--max-restarts": "--max-restarts",
}


def _nproc(text: str) -> int | str:
    if ":" in text:  # MIN:MAX: the autoscaler's range (checked in `run_train_command`)
        return text
    return "auto" if text == "auto" else _positive_int(text)


def default_nproc() -> int:
    """`--nproc auto`: one worker per GPU; on CPU two workers when there are two cores.

    The demo then runs data-parallel through torchrun, as on a cluster, at about the
    speed of one two-threaded worker (benchmarks/train_throughput.py: 0.90-1.02x on a
    quiet 2-core machine; 1.5x once on a loaded one).
    """
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def add_train_arguments(t: argparse.ArgumentParser) -> None:
    """The flags of `bigbatch train`."""
    source = t.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE",
                        help="strategy TOML (default: the task's demo)")
    source.add_argument("--fleet", metavar="FILE",
                        help="a Fleet DistributedStrategy written in TOML with Fleet's names "
                        "(lars_configs, gradient_merge_configs, ...): trains with Fleet's "
                        "semantics, the overview shows the translation (docs/fleet.md)")
    t.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append",
                   default=[], help="override one strategy key (repeatable)")
    t.add_argument("--task", help="built-in task: mnist1d (default) or charlm")
    t.add_argument("--model", help="model of the task (mnist1d: cnn, mlp; charlm: transformer)")
    t.add_argument("--task-opt", dest="task_options", metavar="KEY=VALUE", action="append",
                   default=[], help="task option, e.g. num_samples=5000 (repeatable)")
    length = t.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=_epochs, help="epochs (default: the recipe's)")
    length.add_argument("--steps", type=_positive_int, help="optimizer steps instead of epochs "
                        "(a run shorter than the recipe's gets the task's default warmup "
                        "scaled to it)")
    t.add_argument("--seed", type=_seed, help="seed of init, data order and RNGs (default 0)")
    t.add_argument("--out", help="output directory (default runs/train); one job at a time")
    again = t.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in --out (a longer run, "
                       "another cadence, timeout or number of workers; nothing else may change)")
    again.add_argument("--overwrite", action="store_true",
                       help="replace the run in --out: delete the files bigbatch wrote there "
                       "(and nothing else)")
    t.add_argument("--trust-checkpoint", action="store_true",
                   help="with --resume: accept a checkpoint that has no manifest (a save cut "
                   "short, files copied without their .json); it is still read as tensors "
                   "and plain data only")
    t.add_argument("--checkpoint-every", type=_positive_int, metavar="N",
                   help="optimizer steps between checkpoints (default: once per epoch)")
    t.add_argument("--log-every", type=_positive_int, metavar="N",
                   help="optimizer steps between metrics lines (default: ~10 per epoch)")
    t.add_argument("--eval-every", type=_positive_int, metavar="N",
                   help="optimizer steps between test evaluations (default: once per epoch)")
    t.add_argument("--keep-checkpoints", type=_positive_int, metavar="K",
                   help="how many of the newest checkpoints to keep (default 2)")
    t.add_argument("--timeout", type=_timeout, metavar="SECONDS",
                   help="seconds a worker waits for its peers in a collective or the "
                   "rendezvous (= --set data_parallel.timeout_s=SECONDS; default 300)")
    t.add_argument("--nan-policy", choices=("stop", "skip"),
                   help="on a non-finite loss (fp32/bf16): stop with an error, exit 1 "
                   "(default), or skip the step (stops after 10 in a row)")
    t.add_argument("--lr-find", action="store_true",
                   help="run the LR range test at the global batch before training and train "
                   "at the peak LR it finds (= --set batch.lr_find=true; a resume keeps the "
                   "LR found)")
    t.add_argument("--auto-batch", action="store_true",
                   help="start at the recipe's batch and double it up to the global batch "
                   "as the measured noise scale grows, doubling the peak LR each time "
                   "(= --set batch.schedule=auto; docs/auto-batch.md)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--no-tensorboard", action="store_true", help="no TensorBoard event files")
    launch = t.add_argument_group("launch (torchrun)")
    launch.add_argument("--nproc", type=_nproc, metavar="N",
                        help="workers on this machine, started through torch.distributed.run "
                        "(default auto: one per GPU, else 2 on a CPU with 2+ cores); MIN:MAX: "
                        "the job measures and picks its size (bigbatch.cli.autoscale)")
    launch.add_argument("--nnodes", help="number of machines, or MIN:MAX (torchrun)")
    launch.add_argument("--node-rank", type=_nonneg_int, help="rank of this machine (torchrun)")
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous (torchrun)")
    launch.add_argument("--rdzv-backend", help="rendezvous backend (torchrun, default c10d)")
    launch.add_argument("--rdzv-id", help="job id for the rendezvous (torchrun)")
    launch.add_argument("--max-restarts", type=_nonneg_int,
                        help="restarts of the worker group on failure (torchrun)")
    from bigbatch.cli.autoscale import add_autoscale_arguments

    add_autoscale_arguments(launch)


def under_launcher() -> bool:
    """True inside a worker started by torchrun (or anything that set its environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ)


def resolve(args: argparse.Namespace):
    """(TrainConfig, Strategy) from the flags; on --resume, the saved run fills what is not given."""
    from bigbatch.config.strategy import WARMUP_KEYS, Strategy
    from bigbatch.tasks import task_class
    from bigbatch.train.checkpoint import latest_checkpoint, resume_checkpoint
    from bigbatch.train.lock import check_unlocked
    from bigbatch.train.trainer import RUN_FILE, TrainConfig

    out = Path(args.out or "runs/train")
    # Another job's directory is refused before its checkpoints are read: a save in
    # progress there would otherwise be warned about first (no manifest yet).
    check_unlocked(out)
    resume, overwrite = args.resume, args.overwrite
    if _restarted():
        # torchrun --max-restarts restarts every worker with the same arguments: continue
        # from this job's last checkpoint, or start again over this job's own files.
        resume = latest_checkpoint(out, trust=args.trust_checkpoint) is not None
        overwrite = not resume
    saved: dict = {}
    if resume:
        resume_checkpoint(out, trust=args.trust_checkpoint)  # one there, and a whole one
        try:
            saved = json.loads((out / RUN_FILE).read_text())
        except (OSError, ValueError):
            saved = {}
    given = {
        "task": args.task, "model": args.model, "epochs": args.epochs, "steps": args.steps,
        "seed": args.seed, "checkpoint_every": args.checkpoint_every,
        "log_every": args.log_every, "eval_every": args.eval_every,
        "keep_checkpoints": args.keep_checkpoints, "nan_policy": args.nan_policy,
    }
    file = _file_keys(args.config) if args.config is not None else {}
    fleet = None
    if getattr(args, "fleet", None) is not None:
        from bigbatch.config.fleet import translate

        fleet = translate(Path(args.fleet))
        file = {"warmup": True, **({"task": fleet.task} if fleet.task else {})}
        given["fleet"] = str(args.fleet)
    if "task" in file:
        if args.task is not None and args.task != file["task"]:
            raise ConfigError(f"--task {args.task}: {args.config or args.fleet} is written for task "
                              f"{file['task']!r} (its `task` key); drop --task, or give a "
                              f"strategy file for {args.task}")
        given["task"] = file["task"]
    kept = set(TrainConfig.__dataclass_fields__) - {"out", "resume", "overwrite", "progress",
                                                    "fit_warmup", "trust_checkpoint"}
    fields = {k: v for k, v in saved.items() if k in kept} if isinstance(saved, dict) else {}
    if args.epochs is not None or args.steps is not None:  # a new length replaces the old one
        fields.pop("epochs", None)
        fields.pop("steps", None)
    fields.update({k: v for k, v in given.items() if v is not None})
    if args.task_options:
        fields["task_options"] = task_options(args.task_options)
    user_warmup = bool(file.get("warmup")) or any(
        o.partition("=")[0].strip() in WARMUP_KEYS for o in args.overrides)
    fields.update(out=str(out), resume=resume, overwrite=overwrite, progress=not args.no_progress,
                  fit_warmup=not resume and not user_warmup,
                  trust_checkpoint=args.trust_checkpoint)
    if args.no_tensorboard:
        fields["tensorboard"] = False
    config = TrainConfig(**fields)

    cls = task_class(config.task)
    if fleet is not None:
        strategy = fleet.build()
    elif args.config is not None:
        strategy = Strategy.from_toml(Path(args.config))
    elif resume and (out / "strategy.toml").is_file():
        strategy = Strategy.from_toml(out / "strategy.toml")
    else:
        strategy = Strategy.from_toml(cls.demo_strategy)
    overrides = list(args.overrides)
    if args.timeout is not None:
        overrides.append(f"data_parallel.timeout_s={args.timeout}")
    if args.lr_find:
        overrides.append("batch.lr_find=true")
    if args.auto_batch:
        overrides.append("batch.schedule=auto")
    strategy = strategy.with_overrides(overrides)
    if config.model is not None and config.model not in cls.models:
        raise ConfigError(
            f"model={config.model!r} is not a model of task {config.task!r}; "
            f"valid: {', '.join(cls.models)}"
        )
    return config, strategy


def _file_keys(path: str) -> dict[str, Any]:
    """What a strategy file says besides its sections: its `task` (`FILE_KEYS`), and
    whether it sets the warmup itself (`warmup`). An unreadable file: {} (the Strategy's
    own reading reports it)."""
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    batch = data.get("batch")
    keys = {"warmup": isinstance(batch, dict) and bool({"warmup_steps", "warmup_epochs"} & set(batch))}
    if isinstance(data.get("task"), str):
        keys["task"] = data["task"]
    return keys


def _restarted() -> bool:
    """True in a worker that torchrun restarted (`--max-restarts`) after a failure."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return count.isdigit() and int(count) > 0


def _torchrun_argv(args: argparse.Namespace, argv: list[str], timeout: float) -> list[str]:
    """torchrun's flags, then `-m bigbatch train <argv without launch flags>`."""
    cmd = ["--nproc-per-node", str(args.nproc)]
    if not _multi_node(args):
        cmd.append("--standalone")
    for flag, dest in LAUNCHER_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            cmd += [dest, str(value)]
    if _multi_node(args) and args.rdzv_backend is None:
        cmd += ["--rdzv-backend", "c10d"]
    # Bounds torchrun's rendezvous too (its defaults: 600 s to join, 60 s per store read).
    seconds = max(1, round(timeout))
    cmd += ["--rdzv-conf", f"join_timeout={seconds},read_timeout={seconds}"]
    return [*cmd, "-m", "bigbatch", *_strip_launch_flags(argv)]


def _multi_node(args: argparse.Namespace) -> bool:
    return args.rdzv_endpoint is not None or args.nnodes not in (None, "1", "1:1")


def _strip_launch_flags(argv: list[str]) -> list[str]:
    drop = {"--nproc", *LAUNCHER_FLAGS}
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in drop:
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


def _launch(args: argparse.Namespace, argv: list[str], config, strategy) -> int:
    from bigbatch.cli.launch import run_torchrun
    from bigbatch.train.lock import LOCKED_ENV, hold

    _check_gpus(args.nproc, strategy)
    nnodes = args.nnodes
    if nnodes is None or nnodes.isdigit():
        _check_fleet_world(args, args.nproc * int(nnodes or 1))
    if nnodes is not None and not all(p.isdigit() and int(p) >= 1 for p in nnodes.split(":")):
        raise ConfigError(f"--nnodes={nnodes!r}: expected N or MIN:MAX with integers >= 1")
    if args.rdzv_endpoint is not None:
        from bigbatch.cli.launch import check_endpoint

        check_endpoint(args.rdzv_endpoint, strategy.data_parallel.timeout_s,
                       several_nodes=nnodes not in (None, "1", "1:1"))
    # Batch and schedule mistakes: now, not per worker (unknown with an elastic MIN:MAX).
    # Across nodes the output directory's state is global rank 0's to check (under its
    # lock): another node may already have started writing it.
    preflight(config, strategy,
              args.nproc * int(nnodes or 1) if nnodes is None or nnodes.isdigit() else None,
              checks_out=not _multi_node(args))
    _notes(args, strategy)
    from bigbatch.train.checkpoint import QUIET_ENV

    env = {QUIET_ENV: "1"}  # preflight said which checkpoints are damaged: workers need not
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun would pick 1 and print a banner about it
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.nproc))
    timeout = strategy.data_parallel.timeout_s
    run = dict(command="train", timeout=timeout, endpoint=args.rdzv_endpoint,
               elastic_nodes=":" in (nnodes or ""))
    if _multi_node(args):  # the lock is global rank 0's, wherever it runs
        return run_torchrun(_torchrun_argv(args, argv, timeout), env=env, **run)
    with hold(config.out):
        env[LOCKED_ENV] = str(Path(config.out).resolve())
        return run_torchrun(_torchrun_argv(args, argv, timeout), env=env, **run)


def _check_fleet_world(args: argparse.Namespace, world_size: int | None) -> None:
    """A Fleet file's hybrid degrees name its process count: another one is refused."""
    if getattr(args, "fleet", None) is None or world_size is None:
        return
    from bigbatch.config.fleet import translate

    need = translate(Path(args.fleet)).world_size
    if need is not None and need != world_size:
        raise ConfigError(f"{args.fleet}: its degrees (hybrid_configs) need {need} processes, "
                          f"this job starts {world_size}; use --nproc {need} (x --nnodes)")


def _check_gpus(nproc: int, strategy: Any) -> None:
    """NCCL gives each worker a GPU of its own: more workers than GPUs is refused here, not
    after the rendezvous (two ranks on one GPU fail in NCCL's first collective)."""
    import torch

    if not torch.cuda.is_available() or strategy.data_parallel.backend == "gloo":
        return
    gpus = torch.cuda.device_count()
    if nproc > gpus:
        raise ConfigError(f"--nproc {nproc} starts {nproc} workers on {gpus} GPU(s), and NCCL "
                          f"(data_parallel.backend={strategy.data_parallel.backend}) needs one "
                          f"GPU per worker: use --nproc {gpus} (--nproc auto), or --set "
                          "data_parallel.backend=gloo to let workers share GPUs (slower)")


def _notes(args: argparse.Namespace, strategy: Any) -> None:
    """After every check passed, on stderr: the task a strategy file chose, and a warning
    line for each setting that runs but wastes this machine."""
    import torch

    from bigbatch.train.config import TrainConfig

    task = _file_keys(args.config).get("task") if args.config is not None else None
    if task is not None and args.task is None and task != TrainConfig.task:
        print(f"{args.config}: task {task} (the file's `task` key)", file=sys.stderr)

    cuda = torch.cuda.is_available()
    if cuda:
        devices = torch.cuda.device_count()
    else:
        devices = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    for line in wasteful_settings(args.nproc, strategy, cuda, devices):
        print(f"bigbatch train: warning: {line}", file=sys.stderr, flush=True)


def run_train_command(args: argparse.Namespace, argv: list[str], config: Any,
                      strategy: Any) -> int:
    """`bigbatch train` after `resolve`: launch workers through torchrun, or train here.

    Raises ConfigError on user mistakes (the caller prints one line and exits 2), and
    `bigbatch.train.signals.Stopped` when a signal stopped the run.
    """
    from bigbatch.train.signals import abort_on_signals

    worker = under_launcher()
    if isinstance(args.nproc, str) and ":" in args.nproc:  # issue 40's hook: the autoscaler
        from bigbatch.cli.autoscale import parse_range, run_autoscaled

        if worker:
            raise ConfigError(f"--nproc {args.nproc}: a range is for the launcher, not a worker")
        lo, hi = parse_range(args.nproc)
        return run_autoscaled(args, argv, lo, hi, resolve, _launch)
    if args.nproc in (None, "auto"):
        args.nproc = default_nproc() if not worker else 1
    launching = not worker and (
        args.nproc > 1 or args.nnodes is not None or args.rdzv_endpoint is not None)
    with abort_on_signals():  # until training starts a signal only has to end the process
        if launching and _multi_node(args):  # every node's launcher would have to agree
            return _launch(args, argv, config, strategy)
        if launching:
            from bigbatch.cli.relaunch import run_relaunching

            return run_relaunching(args, argv, config, strategy, resolve, _launch)
        from bigbatch.parallel.world import World

        world = World.from_env() if worker else World()
        _check_fleet_world(args, world.world_size)
        preflight(config, strategy, world.world_size, checks_out=world.rank == 0)
        if not worker:
            _notes(args, strategy)
    from bigbatch.train.trainer import train

    train(config, strategy)
    return 0
