"""Command-line entry point: `bigbatch train | study | gns | plan ...`.

User mistakes (bad flags, a missing config file, an unknown task, a resume
directory without a checkpoint, settings a resume may not change, an output
directory that holds a run or that another job holds) print one line on stderr and
exit with status 2, before anything is written. Failures of a run that started (a
non-finite loss under `--nan-policy`, a failed checkpoint save, a full disk, no
checkpoint left whole to resume from, a peer that did not answer in time, a failed
rendezvous) print one line and exit 1. A run
stopped by SIGTERM, SIGINT or SIGHUP saves a checkpoint, prints one line and exits
with 128 + the signal's number (143, 130, 129).
A policy that ends the run on purpose (`[straggler] action = "stop"`: status 75)
prints its line after a checkpoint and exits with its status; under torchrun the
workers exit 0, so that torchrun does not restart them, and `bigbatch train --nproc N`
returns the status from `OUT/stopped.json`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from bigbatch.cli.argtypes import OneLineParser
from bigbatch.cli.failure_report import ERROR, PEER, PEER_NAMED, fail
from bigbatch.cli.gns import GNS_DESCRIPTION, GNS_HELP
from bigbatch.cli.lr_find import LR_FIND_DESCRIPTION, LR_FIND_HELP
from bigbatch.cli.monitor import MONITOR_DESCRIPTION, MONITOR_HELP, add_monitor_arguments
from bigbatch.cli.plan import PLAN_DESCRIPTION, PLAN_HELP
from bigbatch.cli.study import STUDY_DESCRIPTION, STUDY_HELP
from bigbatch.cli.train import (
    EXIT_USAGE,
    TRAIN_DESCRIPTION,
    TRAIN_HELP,
    add_train_arguments,
    resolve,
    run_train_command,
    under_launcher,
)
from bigbatch.errors import ConfigError, PolicyStop
from bigbatch.train.signals import Stopped, exit_status


class _StderrHandler(logging.Handler):
    # Looks up sys.stderr at each record: a live progress bar swaps it to keep itself whole.
    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def _setup_logging() -> None:
    """bigbatch's INFO messages (data generation, batch-size changes) as plain stderr lines,
    unless the process has configured logging itself."""
    logger = logging.getLogger("bigbatch")
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)



def _run_failure(command: str, e: RuntimeError, strategy) -> tuple[str, int, bool] | None:
    """The line for a run that failed with `e`, its kind (`bigbatch.cli.failure_report`)
    and whether this rank is the one to print it where each prints its own; None for an
    error we cannot explain (its traceback is the report)."""
    from bigbatch.errors import PipelineError
    from bigbatch.parallel.data_parallel import UnusedParametersError
    from bigbatch.parallel.world import is_peer_failure
    from bigbatch.train.nonfinite import NonFiniteLossError

    if isinstance(e, NonFiniteLossError | PipelineError | UnusedParametersError):
        return str(e), ERROR, True
    from bigbatch.cli.failure_report import out_of_memory

    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    oom = out_of_memory(e, strategy, world_size)
    if oom is not None:
        return oom, ERROR, True
    if command == "train" and under_launcher() and is_peer_failure(e):
        from bigbatch.parallel.roll_call import failed_in, roll_call

        timeout = strategy.data_parallel.timeout_s if strategy is not None else 300.0
        where = failed_in(e)
        where = f" in {where}" if where else ""
        rank = int(os.environ.get("RANK", "0") or 0)
        missing = roll_call(rank, world_size)
        if not missing:
            return (f"a peer did not answer within data_parallel.timeout_s={timeout:g}s{where} "
                    "(dead or hung worker)"), PEER, True
        answered = set(range(world_size)) - {r for r, _ in missing}
        ranks = ", ".join(f"{r} (host {h})" if h else str(r) for r, h in missing)
        return (f"worker rank{'s' if len(missing) > 1 else ''} {ranks} did not answer within "
                f"data_parallel.timeout_s={timeout:g}s{where} (hung or stopped); continue "
                "from the last checkpoint with --resume, or give a slow worker more time "
                "with --timeout"), PEER_NAMED, rank == min(answered)
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; `study` and `gns` get their flags only when `command` names them
    (their modules, and what those import, stay out of every `train` worker)."""
    parser = OneLineParser(prog="bigbatch", description="Large-batch distributed training for PyTorch.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    t = sub.add_parser("train", help=TRAIN_HELP, description=TRAIN_DESCRIPTION)
    add_train_arguments(t)
    study = sub.add_parser("study", help=STUDY_HELP, description=STUDY_DESCRIPTION)
    gns = sub.add_parser("gns", help=GNS_HELP, description=GNS_DESCRIPTION)
    lr_find = sub.add_parser("lr-find", help=LR_FIND_HELP, description=LR_FIND_DESCRIPTION)
    if command == "lr-find":
        from bigbatch.cli.lr_find import add_lr_find_arguments

        add_lr_find_arguments(lr_find)
    add_monitor_arguments(sub.add_parser("monitor", help=MONITOR_HELP,
                                         description=MONITOR_DESCRIPTION))
    plan = sub.add_parser("plan", help=PLAN_HELP, description=PLAN_DESCRIPTION)
    if command == "plan":
        from bigbatch.cli.plan import add_plan_arguments

        add_plan_arguments(plan)
    if command == "study":
        from bigbatch.cli.study import add_study_arguments

        add_study_arguments(study)
    elif command == "gns":
        from bigbatch.cli.gns import add_gns_arguments

        add_gns_arguments(gns)
    return parser


def _set_without_equals(argv: list[str]) -> str | None:
    """The one line for a `--set` whose value is not section.key=value (argparse would say
    only "unrecognized arguments: 64" for ``--set batch.global_batch_size 64``)."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return None
        if arg != "--set":
            continue
        item = argv[i + 1] if i + 1 < len(argv) else None
        if item is None or item.startswith("--"):
            return "--set takes section.key=value, got --set with no value"
        if "=" in item:
            continue
        value = argv[i + 2] if i + 2 < len(argv) and not argv[i + 2].startswith("--") else None
        if value is None:
            return f"--set takes section.key=value, got --set {item!r}"
        return (f"--set takes section.key=value, got --set {item} {value} "
                f"(write --set {item}={value})")
    return None


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # this process's own command line: it ends with main()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    if (line := _set_without_equals(argv)) is not None:
        print(f"bigbatch {command}: error: {line}", file=sys.stderr)
        return EXIT_USAGE
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, one line already printed)
        return int(e.code or 0)
    if args.version:
        from bigbatch import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "train" and "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker
        from bigbatch.cli.launch import bind_to_launcher

        bind_to_launcher()
    _setup_logging()
    if args.command == "study":
        from bigbatch.cli.study import run_study_command

        return run_study_command(args)
    strategy = config = None
    try:
        if args.command == "monitor":
            from bigbatch.cli.monitor import run_monitor_command

            return run_monitor_command(args)
        if args.command == "gns":
            from bigbatch.cli.gns import run_gns_command

            return run_gns_command(args)
        if args.command == "lr-find":
            from bigbatch.cli.lr_find import run_lr_find_command

            return run_lr_find_command(args)
        if args.command == "plan":
            from bigbatch.cli.plan import run_plan_command

            return run_plan_command(args)
        config, strategy = resolve(args)
        started = time.time()
        status = run_train_command(args, argv, config, strategy)
        if not under_launcher():  # torchrun's status is 0 or 1; a policy's stop says more
            from bigbatch.train.stopped import read_stopped

            stopped = read_stopped(config.out, started)
            if stopped is not None:
                return stopped[1]
        return status
    except PolicyStop as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"bigbatch {args.command}: {e}", file=sys.stderr)
        return 0 if under_launcher() and int(os.environ.get("WORLD_SIZE", "1")) > 1 else e.status
    except ConfigError as e:
        return fail(f"bigbatch {args.command}: error: {e}", EXIT_USAGE)
    except Stopped as e:
        if os.environ.get("RANK", "0") == "0":  # every worker stopped alike: one says so
            print(f"bigbatch {args.command}: {e}", file=sys.stderr)
        return exit_status(e.signum)
    except RuntimeError as e:  # exit 1: the run failed, not its input
        found = _run_failure(args.command, e, strategy)
        if found is None:
            raise
        line, kind, speaks = found
        return fail(f"bigbatch {args.command}: error: {line}", 1, kind, speaks)
    except OSError as e:  # exit 1: a full disk, a lost mount, damaged files (not a usage mistake)
        from bigbatch.train.checkpoint import WriteError

        if getattr(e, "everywhere", False) and os.environ.get("RANK", "0") != "0":
            return 1  # every worker raised it alike: rank 0 says it
        text = str(e) if isinstance(e, WriteError) or not e.strerror else (
            f"{e.strerror}: {e.filename}" if e.filename else e.strerror)
        return fail(f"bigbatch {args.command}: error: {text}")
    except KeyboardInterrupt:  # a second Ctrl-C: at once, without the stop's checkpoint
        if own_process:  # a third Ctrl-C cuts short neither this line nor the exit
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if os.environ.get("RANK", "0") != "0":
            return 130
        line = "interrupted"
        if config is not None:
            from bigbatch.train.signals import checkpoint_note

            line += f"; {checkpoint_note(config.out)}"
        print(f"bigbatch {args.command}: {line}", file=sys.stderr)
        return 130
