"""`bigbatch study`: its flags, the StudyConfig they make (defaults < --quick < --config <
flags), and the command."""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from bigbatch.cli.argtypes import OneLineParser, task_options
from bigbatch.cli.argtypes import epochs as _epochs
from bigbatch.cli.argtypes import nonneg_float as _nonneg_float
from bigbatch.cli.argtypes import number as _float
from bigbatch.cli.argtypes import positive_int as _positive_int
from bigbatch.cli.argtypes import seed as _seed
from bigbatch.errors import ConfigError
from bigbatch.train.signals import Stopped, exit_status

__all__ = ["add_study_arguments", "config_from_args", "parse_batches", "parse_overrides",
           "parse_seeds", "parse_strategies"]


STUDY_HELP = "batch-size scaling study and its report"
STUDY_DESCRIPTION = ("Train every (strategy, global batch, seed) cell at a fixed epoch budget "
                     "and write a report: table, figures, noise scale, and the steps that "
                     "growing batches and AdaScale save at equal quality.")


def _strategy_names() -> tuple[str, ...]:
    from bigbatch.study.rules import STRATEGIES

    return STRATEGIES


def parse_batches(text: str) -> list[int]:
    """`"64,256,1024"` -> `[64, 256, 1024]` (ConfigError naming the bad item)."""
    out = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            raise ConfigError(f"--batches={text!r}: {item.strip()!r} is not an integer; "
                              "expected e.g. 64,256,1024") from None
        if value < 1:
            raise ConfigError(f"--batches={text!r}: {value} is out of range; allowed: >= 1")
        out.append(value)
    return out


def parse_strategies(text: str) -> list[str]:
    from bigbatch.study.schedules import check_name, valid_forms

    names = [s.strip() for s in text.split(",") if s.strip()]
    for s in names or [text]:
        if not check_name(s, _strategy_names()):
            raise ConfigError(f"--strategies={text!r}: {s!r} is not a strategy; "
                              f"valid: {valid_forms(_strategy_names())}")
    return names


def parse_seeds(text: str) -> list[int]:
    """`"0,1,2"` -> `[0, 1, 2]` (ConfigError naming the bad item)."""
    out = []
    for item in text.split(","):
        try:
            out.append(_seed(item.strip()))
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ConfigError(f"--seeds={text!r}: {item.strip()!r} is not a seed: {e}; "
                              "give e.g. 0,1,2") from None
    return out


def parse_overrides(items: list[str]) -> dict[str, list[str]]:
    """`["lars:lars.lars_coeff=0.02", "batch.warmup_epochs=1"]` -> per-strategy lists."""
    out: dict[str, list[str]] = {}
    for item in items:
        head, colon, rest = item.partition(":")
        key, body = (head.strip(), rest) if colon and "=" not in head else ("all", item)
        out.setdefault(key, []).append(body.strip())
    return out




def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `bigbatch study` (the CLI adds a subparser and calls this)."""
    a = parser.add_argument
    a("--config", metavar="FILE", help="study TOML: a [study] table with these flags' keys, "
      "and [set] lists of overrides per strategy (flags given here win)")
    a("--task", help="built-in task: mnist1d (default) or charlm")
    a("--model", help="model of the task (default: the task's)")
    a("--task-opt", dest="task_options", metavar="KEY=VALUE", action="append", default=[],
      help="task option, e.g. num_samples=20000 (repeatable)")
    a("--batches", metavar="B1,B2,...", help="global batch sizes (default: base x 1,4,16,64)")
    a("--strategies", metavar="S1,S2", help=f"of {', '.join(_strategy_names())}, or "
      "STRATEGY@SCHEDULE (adaptive, seesaw, goodput, doubling: a batch growing from the "
      "recipe's up to the cell's) (default: sgd and lars, or lamb for an AdamW recipe)")
    a("--epochs", type=_epochs, help="epoch budget of every cell (default: the recipe's)")
    a("--target", type=_float, help="test-metric target for steps-to-target "
      "(default: the small-batch baseline's final value minus 1 point / plus 0.05 bpc)")
    a("--tolerance", type=_nonneg_float, help="allowed loss vs the baseline for 'keeps accuracy' "
      "(default 0.005 accuracy, 0.02 bpc)")
    a("--micro-batch", dest="micro_batch_size", type=_positive_int, metavar="N",
      help="per-worker micro-batch; larger batches merge gradients (default 128)")
    a("--warmup-epochs", type=_nonneg_float, help="warmup of the scaled strategies (default: "
      "epochs/8, or the recipe's warmup if longer, scaled down with a shorter budget)")
    a("--evals-per-epoch", type=_positive_int, metavar="N", help="test evaluations per epoch "
      "(default 4)")
    a("--set", dest="overrides", metavar="[STRATEGY:]SECTION.KEY=VALUE", action="append",
      default=[], help="override a strategy key in every cell, or in one strategy's cells")
    a("--lr-find", action="store_true", help="every cell runs the LR range test before "
      "training and trains at the LR it finds ([batch] lr_find = true)")
    a("--seed", type=_seed, help="seed of every cell (default 0)")
    a("--seeds", metavar="S1,S2", help="seeds: every cell runs once per seed, and the report "
      "gives mean ± std over them (default: --seed)")
    a("--nproc", type=_positive_int, metavar="N", help="workers per cell (default 1: in-process)")
    a("--threads", type=_positive_int, metavar="N", help="torch threads per worker (default: "
      "torch's; use 1 on a shared CPU, --quick does)")
    a("--out", help="output directory (default runs/study)")
    a("--quick", action="store_true", help="a small grid that runs in minutes on 2 CPU cores")
    a("--report-only", action="store_true", help="write the report from finished cells only")
    a("--no-progress", action="store_true", help="no live progress bar (one line per cell)")


def config_from_args(args: argparse.Namespace) -> Any:
    """The StudyConfig of the flags: defaults < --quick preset < --config file < flags."""
    from bigbatch.study.config import QUICK, StudyConfig

    values: dict[str, Any] = {}
    task = args.task
    file: dict[str, Any] = {}
    if args.config is not None:
        try:
            file = tomllib.loads(Path(args.config).read_text())
        except OSError as e:
            raise ConfigError(f"--config {args.config}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--config {args.config}: not UTF-8 text") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {args.config}: {e}") from None
        for table in ("study", "set"):
            if not isinstance(file.get(table, {}), dict):
                raise ConfigError(f"--config {args.config}: `{table}` must be a [{table}] table")
        unknown = set(file) - {"study", "set"}
        if unknown:
            raise ConfigError(f"--config: unknown table [{sorted(unknown)[0]}]; valid: [study], [set]")
        written_for = file.get("study", {}).get("task")
        if task is not None and written_for is not None and task != written_for:
            raise ConfigError(f"--task {task}: {args.config} is a study of task {written_for!r} "
                              f"(its study.task); drop --task, or give a study file for {task}")
        task = task or written_for
    if args.quick:
        values.update(QUICK.get(task or "mnist1d", {}))
    study = dict(file.get("study", {}))
    known = {f.name for f in fields(StudyConfig)}
    for key in study:
        if key not in known:
            raise ConfigError(f"--config: unknown key study.{key}; valid: {', '.join(sorted(known))}")
    values.update(study)
    for key, items in file.get("set", {}).items():
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"--config: set.{key} must be a list of \"section.key=value\" "
                              f"strings, got {items!r}")
    overrides = {k: list(v) for k, v in file.get("set", {}).items()}
    for key, items in parse_overrides(args.overrides).items():
        overrides.setdefault(key, []).extend(items)
    if overrides:
        values["overrides"] = overrides
    if args.task_options:
        values["task_options"] = task_options(args.task_options)
    given = {"task": args.task, "model": args.model, "epochs": args.epochs, "target": args.target,
             "tolerance": args.tolerance, "micro_batch_size": args.micro_batch_size,
             "warmup_epochs": args.warmup_epochs, "evals_per_epoch": args.evals_per_epoch,
             "seed": args.seed, "nproc": args.nproc, "threads": args.threads, "out": args.out,
             "seeds": parse_seeds(args.seeds) if args.seeds else None,
             "batches": parse_batches(args.batches) if args.batches else None,
             "strategies": parse_strategies(args.strategies) if args.strategies else None}
    if args.seed is not None and args.seeds:
        raise ConfigError(f"--seed {args.seed} and --seeds {args.seeds} are both given; give one")
    if args.seed is not None:  # one seed from the command line wins over the file's seeds
        values.pop("seeds", None)
    values.update({k: v for k, v in given.items() if v is not None})
    if args.no_progress:
        values["progress"] = False
    if args.lr_find:
        values["lr_find"] = True
    if args.quick and "out" not in values:
        values["out"] = "runs/study-quick"
    try:
        return StudyConfig(**values)
    except TypeError as e:  # a wrongly typed value from the file
        raise ConfigError(f"--config: {e}") from None


# ----------------------------------------------------------------- command line


def run_study_command(args: argparse.Namespace) -> int:
    """`bigbatch study` after parsing; one-line errors, exit status 2 on user mistakes."""
    from bigbatch.study.sweep import run_study

    try:
        config = config_from_args(args)
        argv = sys.argv[1:]
        argv = argv if argv[:1] == ["study"] else ["study", *argv]
        results = run_study(config, run_missing=not args.report_only, argv=argv)
    except ConfigError as e:
        print(f"bigbatch study: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bigbatch study: interrupted (finished cells are kept)", file=sys.stderr)
        return 130
    except Stopped as e:  # the cell in training saved a checkpoint: a rerun resumes it
        print(f"bigbatch study: stopped by {e.name} (finished cells are kept, the current one "
              "resumes)", file=sys.stderr)
        return exit_status(e.signum)
    print(f"report: {Path(config.out) / 'report.md'}", file=sys.stderr)
    failed = [c for c in results["cells"] if c["status"] == "failed"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m bigbatch.cli.study ...` (the same as `bigbatch study ...`)."""
    parser = OneLineParser(prog="bigbatch study", description=STUDY_DESCRIPTION)
    add_study_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, one line already printed)
        return int(e.code or 0)
    return run_study_command(args)


if __name__ == "__main__":
    sys.exit(main())
