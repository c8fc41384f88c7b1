"""`bigbatch study`: a batch-size sweep at a fixed epoch budget, and its report.

Every (strategy, global batch) cell trains the same task from the same seed for
the same number of epochs; each strategy scales one small-batch recipe (the
task's `Recipe`) by its own rule (`RULES`). Each cell writes the usual `train`
outputs under `OUT/cells/<strategy>-b<batch>/`; the study then reads their
`metrics.jsonl` / `summary.json` and writes `OUT/report.md`, `OUT/results.json`
and PNG figures (`bigbatch._report`).

A finished cell (its `summary.json` present and its `study_cell.json` equal to
what the cell would be now) is kept on restart; an interrupted one resumes from
its last checkpoint. Cells run one after another: in this process (`nproc=1`,
calling `train()`), or through `python -m bigbatch train --nproc N`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from bigbatch.errors import ConfigError

STRATEGIES = ("sgd", "lars", "lamb", "adascale")
RULES = {
    "sgd": "the recipe's optimizer, linear LR scaling + gradual warmup (Goyal et al. 2017)",
    "lars": "LARS on momentum SGD, linear LR scaling + warmup (You et al. 2017)",
    "lamb": "LAMB on AdamW, square-root LR scaling + warmup (You et al. 2020)",
    "adascale": "the recipe's optimizer, AdaScale LR gain, no scaling rule (Johnson et al. 2020)",
}
CELL_FILE, PENDING_FILE, CELL_STRATEGY = "study_cell.json", "study_pending.json", "study_strategy.toml"
LAYERWISE_EXCLUDE = ["bn", "norm", "bias"]
#: LR of LARS / LAMB when the recipe's optimizer is the other family (their per-step
#: relative update is about lr x lars_coeff x 1/(1-momentum), resp. lr).
LARS_DEFAULT = {"lars_coeff": 0.01, "base_lr": 0.1}
LAMB_DEFAULT = {"base_lr": 0.01, "weight_decay": 0.01}

QUICK = {  # per task: a grid that finishes in a few minutes on 2 CPU cores
    "mnist1d": {"model": "cnn", "task_options": {"num_samples": 20000}, "epochs": 8,
                "batches": [64, 256, 1024, 4096], "strategies": ["sgd", "lars"]},
    "charlm": {"task_options": {"d_model": 64, "n_layer": 1, "seq_len": 32}, "epochs": 1,
               "batches": [16, 64, 256, 1024], "strategies": ["sgd", "lamb"]},
}


@dataclass
class StudyConfig:
    """One batch-size study: the grid, the budget and where to write."""

    task: str = "mnist1d"
    """Built-in task."""
    model: str | None = None
    """Model of the task; None: its default."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Task constructor options (e.g. `num_samples`)."""
    batches: list[int] | None = None
    """Global batch sizes; None: the recipe's base batch x 1, 4, 16, 64."""
    strategies: list[str] | None = None
    """Strategy names from `STRATEGIES`; None: sgd and the layer-wise one for the recipe."""
    epochs: float | None = None
    """Epoch budget of every cell; None: the recipe's."""
    target: float | None = None
    """Test-metric target for steps-to-target; None: the baseline's final value -/+ 1 point."""
    tolerance: float | None = None
    """Allowed loss vs the baseline for "keeps accuracy"; None: 0.005 (accuracy) / 0.02 (bpc)."""
    micro_batch_size: int = 128
    """Per-worker micro-batch (gradient merge above it); also the noise scale's small batch."""
    warmup_epochs: float | None = None
    """Warmup of the scaled strategies; None: max(recipe's, epochs / 8)."""
    evals_per_epoch: int = 4
    """Test evaluations per epoch when `train` supports `eval_every` (else one per epoch)."""
    overrides: dict[str, list[str]] = field(default_factory=dict)
    """Strategy name (or "all") -> `section.key=value` overrides of its cells."""
    seed: int = 0
    """Seed of every cell (same init and data order)."""
    nproc: int = 1
    """Workers per cell; > 1 launches `bigbatch train` through torchrun."""
    out: str = "runs/study"
    """Output directory."""
    progress: bool = True
    """Show overall progress."""

    def __post_init__(self) -> None:
        if self.batches is not None:
            if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
                raise ConfigError(f"batches={self.batches} must be integers >= 1")
            self.batches = sorted(set(self.batches))
        if self.strategies is not None:
            bad = [s for s in self.strategies if s not in STRATEGIES]
            if bad or not self.strategies:
                raise ConfigError(f"strategies={bad or '[]'}: unknown; valid: {', '.join(STRATEGIES)}")
            self.strategies = list(dict.fromkeys(self.strategies))
        for name, low in (("micro_batch_size", 1), ("evals_per_epoch", 1), ("nproc", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"{name}={getattr(self, name)} is out of range; allowed: >= {low}")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"epochs={self.epochs} is out of range; allowed: > 0")
        for key in self.overrides:
            if key != "all" and key not in STRATEGIES:
                raise ConfigError(f"--set {key}:...: unknown strategy; valid: all, {', '.join(STRATEGIES)}")


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
    names = [s.strip() for s in text.split(",") if s.strip()]
    for s in names or [text]:
        if s not in STRATEGIES:
            raise ConfigError(f"--strategies={text!r}: {s!r} is not a strategy; "
                              f"valid: {', '.join(STRATEGIES)}")
    return names


def parse_overrides(items: list[str]) -> dict[str, list[str]]:
    """`["lars:lars.lars_coeff=0.02", "batch.warmup_epochs=1"]` -> per-strategy lists."""
    out: dict[str, list[str]] = {}
    for item in items:
        head, colon, rest = item.partition(":")
        key, body = (head.strip(), rest) if colon and "=" not in head else ("all", item)
        out.setdefault(key, []).append(body.strip())
    return out


# ----------------------------------------------------------------- the cells


@dataclass
class Cell:
    """One (strategy, global batch) run."""

    name: str
    batch: int
    dir: Path
    strategy: Any
    spec: dict[str, Any]


def resolved(config: StudyConfig) -> tuple[StudyConfig, Any]:
    """A copy of `config` with every None default filled from the task recipe, and the recipe."""
    from bigbatch.tasks import get_task

    task = get_task(config.task, **config.task_options)
    model = task.check_model(config.model)
    recipe = task.recipe(model)
    c = StudyConfig(**{f.name: getattr(config, f.name) for f in fields(StudyConfig)})
    c.model = model
    c.epochs = recipe.epochs if c.epochs is None else c.epochs
    c.batches = c.batches or [recipe.base_batch_size * 4**i for i in range(4)]
    layerwise = "lars" if recipe.optimizer == "momentum" else "lamb"
    c.strategies = c.strategies or ["sgd", layerwise]
    c.warmup_epochs = _warmup_epochs(c, recipe)
    n_train = len(task.train_set)
    for b in c.batches:
        if b > n_train:
            raise ConfigError(f"--batches: {b} is larger than the training set "
                              f"({n_train} samples); allowed: <= {n_train}")
    return c, (task, recipe)


def _warmup_epochs(c: StudyConfig, recipe: Any) -> float:
    if c.warmup_epochs is not None:
        return c.warmup_epochs
    return max(recipe.warmup_epochs, (c.epochs or recipe.epochs) / 8)


def cell_strategy(c: StudyConfig, recipe: Any, name: str, batch: int) -> Any:
    """The Strategy of cell (`name`, `batch`): the recipe scaled by the strategy's rule."""
    from bigbatch.strategy import Strategy

    micro = min(c.micro_batch_size, max(1, batch // c.nproc))
    if batch % (micro * c.nproc):
        raise ConfigError(f"--batches: {batch} is not a multiple of micro batch {micro} x "
                          f"nproc {c.nproc}; use multiples of {micro * c.nproc}")
    momentum_recipe = recipe.optimizer == "momentum"
    b = {"global_batch_size": batch, "micro_batch_size": micro,
         "base_batch_size": recipe.base_batch_size, "base_lr": recipe.base_lr,
         "scaling": "linear", "warmup_epochs": _warmup_epochs(c, recipe), "decay": recipe.decay}
    opt: dict[str, Any] = {"type": recipe.optimizer, "weight_decay": recipe.weight_decay}
    if momentum_recipe:
        opt["momentum"] = recipe.momentum
    else:
        opt.update(beta1=recipe.momentum, epsilon=1e-6)
    d: dict[str, Any] = {"batch": b, "optimizer": opt, "gradient_merge": {"avg": True},
                         "adaptive": {"noise_scale": True}}
    if name == "lars":
        if not momentum_recipe:
            b["base_lr"] = LARS_DEFAULT["base_lr"]
        d["optimizer"] = {"type": "momentum", "momentum": 0.9, "weight_decay": 0.0}
        d["lars"] = {"lars_coeff": LARS_DEFAULT["lars_coeff"],
                     "lars_weight_decay": recipe.weight_decay if momentum_recipe else 5e-4,
                     "exclude_from_weight_decay": LAYERWISE_EXCLUDE}
    elif name == "lamb":
        b["scaling"] = "sqrt"
        if momentum_recipe:
            b["base_lr"] = LAMB_DEFAULT["base_lr"]
        d["optimizer"] = {"type": "adamw", "beta1": 0.9, "epsilon": 1e-6, "weight_decay": 0.0}
        d["lamb"] = {"lamb_weight_decay": LAMB_DEFAULT["weight_decay"] if momentum_recipe
                     else recipe.weight_decay, "exclude_from_weight_decay": LAYERWISE_EXCLUDE}
    elif name == "adascale":
        b.update(scaling="none", warmup_epochs=recipe.warmup_epochs)
        d["adaptive"]["lr"] = "adascale"
    s = Strategy.from_dict(d)
    return s.with_overrides([*c.overrides.get("all", []), *c.overrides.get(name, [])])


def _eval_field() -> str | None:
    from bigbatch.train import TrainConfig

    return next((f for f in ("eval_every", "eval_every_steps") if f in TrainConfig.__dataclass_fields__),
                None)


def build_cells(c: StudyConfig, task: Any, recipe: Any) -> list[Cell]:
    """Every cell, validated (batch arithmetic and schedule) before anything runs."""
    from bigbatch.train import TrainConfig, plan_run

    cells, out = [], Path(c.out) / "cells"
    eval_key = _eval_field()
    for name in c.strategies:
        for batch in c.batches:
            s = cell_strategy(c, recipe, name, batch)
            tc = TrainConfig(task=c.task, model=c.model, task_options=c.task_options,
                             epochs=c.epochs, seed=c.seed)
            sampler = plan_run(tc, s, task, c.nproc)[1]
            eval_every = None
            if eval_key is not None:
                eval_every = max(1, sampler.steps_per_epoch // c.evals_per_epoch)
            spec = {"task": c.task, "model": c.model, "task_options": c.task_options,
                    "epochs": c.epochs, "seed": c.seed, "nproc": c.nproc,
                    "eval_every": eval_every, "strategy": s.to_dict()}
            spec = json.loads(json.dumps(spec))  # the form it has when read back
            cells.append(Cell(name, batch, out / f"{name}-b{batch}", s, spec))
    return cells


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_finished(cell: Cell) -> bool:
    """The cell's outputs exist and were made by exactly this cell."""
    return ((cell.dir / "summary.json").is_file()
            and _read_json(cell.dir / CELL_FILE) == cell.spec)


def _resumable(cell: Cell) -> bool:
    from bigbatch.checkpoint import latest_checkpoint

    return (_read_json(cell.dir / PENDING_FILE) == cell.spec
            and latest_checkpoint(cell.dir) is not None)


@contextlib.contextmanager
def _isolated():
    """Restore the process-global state a training run changes (RNGs, threads, grad mode)."""
    import numpy as np
    import torch

    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate(),
             torch.get_num_threads(), torch.is_grad_enabled())
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
        torch.set_num_threads(saved[3])
        torch.set_grad_enabled(saved[4])


def _run_in_process(cell: Cell, resume: bool) -> None:
    from bigbatch.train import TrainConfig, train

    spec = cell.spec
    extra = {_eval_field(): spec["eval_every"]} if spec["eval_every"] else {}
    config = TrainConfig(task=spec["task"], model=spec["model"], task_options=spec["task_options"],
                         epochs=spec["epochs"], seed=spec["seed"], out=str(cell.dir),
                         resume=resume, progress=False, tensorboard=False, keep_checkpoints=1,
                         **extra)
    with _isolated(), open(cell.dir / "train.log", "a") as log, contextlib.redirect_stderr(log):
        train(config, cell.strategy)


def _toml_literal(value: Any) -> str:
    import tomli_w

    return tomli_w.dumps({"v": value}).strip()[4:]


def train_command(cell: Cell, resume: bool) -> list[str]:
    """`python -m bigbatch train ...` for a cell (the nproc > 1 path)."""
    spec = cell.spec
    cmd = [sys.executable, "-m", "bigbatch", "train", "--config", str(cell.dir / CELL_STRATEGY),
           "--task", spec["task"], "--model", spec["model"], "--epochs", repr(spec["epochs"]),
           "--seed", str(spec["seed"]), "--out", str(cell.dir), "--nproc", str(spec["nproc"]),
           "--no-progress", "--no-tensorboard"]
    for key, value in spec["task_options"].items():
        cmd += ["--task-opt", f"{key}={_toml_literal(value)}"]
    if spec["eval_every"]:
        cmd += ["--eval-every", str(spec["eval_every"])]
    return cmd + (["--resume"] if resume else [])


def _run_subprocess(cell: Cell, resume: bool) -> None:
    (cell.dir / CELL_STRATEGY).write_text(cell.strategy.to_toml())
    with open(cell.dir / "train.log", "a") as log:
        rc = subprocess.call(train_command(cell, resume), stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"bigbatch train exited with status {rc} (see {cell.dir / 'train.log'})")


def run_cell(cell: Cell) -> dict[str, Any]:
    """Train one cell (resuming an interrupted one); returns its status record."""
    cell.dir.mkdir(parents=True, exist_ok=True)
    resume = _resumable(cell)
    (cell.dir / CELL_FILE).unlink(missing_ok=True)
    (cell.dir / PENDING_FILE).write_text(json.dumps(cell.spec, indent=1) + "\n")
    t0 = time.perf_counter()
    try:
        (_run_in_process if cell.spec["nproc"] == 1 else _run_subprocess)(cell, resume)
    except ConfigError:
        raise
    except Exception as e:  # one broken cell must not lose the others
        return {"status": "failed", "error": f"{type(e).__name__}: {e}",
                "run_wall_s": time.perf_counter() - t0}
    (cell.dir / CELL_FILE).write_text(json.dumps(cell.spec, indent=1) + "\n")
    (cell.dir / PENDING_FILE).unlink(missing_ok=True)
    return {"status": "resumed" if resume else "ran", "run_wall_s": time.perf_counter() - t0}


def run_study(config: StudyConfig, *, run_missing: bool = True,
              argv: list[str] | None = None) -> dict[str, Any]:
    """Run (or reuse) every cell, then write the report; returns the results."""
    from bigbatch import _report
    from bigbatch._study_progress import StudyProgress

    c, (task, recipe) = resolved(config)
    cells = build_cells(c, task, recipe)
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(asdict(c), indent=2) + "\n")
    status: dict[str, dict[str, Any]] = {}
    todo = [cell for cell in cells if not is_finished(cell)]
    for cell in cells:
        if cell not in todo:
            status[cell.dir.name] = {"status": "kept"}
    if run_missing and todo:
        with StudyProgress(todo, c.epochs, enabled=c.progress) as progress:
            for cell in todo:
                progress.start(cell)
                status[cell.dir.name] = record = run_cell(cell)
                progress.done(cell, record)
    elif todo:
        for cell in todo:
            status[cell.dir.name] = {"status": "missing"}
    results = _report.collect(c, task, recipe, cells, status, argv=argv)
    _report.write(results, out)
    return results


# ----------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


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
    a("--strategies", metavar="S1,S2", help=f"of {', '.join(STRATEGIES)} (default: sgd and "
      "lars, or lamb for an AdamW recipe)")
    a("--epochs", type=_float, help="epoch budget of every cell (default: the recipe's)")
    a("--target", type=_float, help="test-metric target for steps-to-target "
      "(default: the small-batch baseline's final value minus 1 point / plus 0.05 bpc)")
    a("--tolerance", type=_float, help="allowed loss vs the baseline for 'keeps accuracy' "
      "(default 0.005 accuracy, 0.02 bpc)")
    a("--micro-batch", dest="micro_batch_size", type=_positive_int, metavar="N",
      help="per-worker micro-batch; larger batches merge gradients (default 128)")
    a("--warmup-epochs", type=_float, help="warmup of the scaled strategies (default epochs/8)")
    a("--evals-per-epoch", type=_positive_int, metavar="N", help="test evaluations per epoch "
      "(default 4; needs train's --eval-every)")
    a("--set", dest="overrides", metavar="[STRATEGY:]SECTION.KEY=VALUE", action="append",
      default=[], help="override a strategy key in every cell, or in one strategy's cells")
    a("--seed", type=int, help="seed of every cell (default 0)")
    a("--nproc", type=_positive_int, metavar="N", help="workers per cell (default 1: in-process)")
    a("--out", help="output directory (default runs/study)")
    a("--quick", action="store_true", help="a small grid that runs in minutes on 2 CPU cores")
    a("--report-only", action="store_true", help="write the report from finished cells only")
    a("--no-progress", action="store_true", help="no progress display")


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """Defaults < --quick preset < --config file < flags."""
    values: dict[str, Any] = {}
    task = args.task
    file: dict[str, Any] = {}
    if args.config is not None:
        try:
            file = tomllib.loads(Path(args.config).read_text())
        except OSError as e:
            raise ConfigError(f"--config {args.config}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {args.config}: {e}") from None
        unknown = set(file) - {"study", "set"}
        if unknown:
            raise ConfigError(f"--config: unknown table [{sorted(unknown)[0]}]; valid: [study], [set]")
        task = task or file.get("study", {}).get("task")
    if args.quick:
        values.update(QUICK.get(task or "mnist1d", {}))
    study = dict(file.get("study", {}))
    known = {f.name for f in fields(StudyConfig)}
    for key in study:
        if key not in known:
            raise ConfigError(f"--config: unknown key study.{key}; valid: {', '.join(sorted(known))}")
    values.update(study)
    overrides = {k: list(v) for k, v in file.get("set", {}).items()}
    for key, items in parse_overrides(args.overrides).items():
        overrides.setdefault(key, []).extend(items)
    if overrides:
        values["overrides"] = overrides
    if args.task_options:
        from bigbatch.cli import _parse_options

        values["task_options"] = _parse_options(args.task_options)
    given = {"task": args.task, "model": args.model, "epochs": args.epochs, "target": args.target,
             "tolerance": args.tolerance, "micro_batch_size": args.micro_batch_size,
             "warmup_epochs": args.warmup_epochs, "evals_per_epoch": args.evals_per_epoch,
             "seed": args.seed, "nproc": args.nproc, "out": args.out,
             "batches": parse_batches(args.batches) if args.batches else None,
             "strategies": parse_strategies(args.strategies) if args.strategies else None}
    values.update({k: v for k, v in given.items() if v is not None})
    if args.no_progress:
        values["progress"] = False
    if args.quick and "out" not in values:
        values["out"] = "runs/study-quick"
    try:
        return StudyConfig(**values)
    except TypeError as e:  # a wrongly typed value from the file
        raise ConfigError(f"--config: {e}") from None


def run_study_command(args: argparse.Namespace) -> int:
    """`bigbatch study` after parsing; one-line errors, exit status 2 on user mistakes."""
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
    print(f"report: {Path(config.out) / 'report.md'}", file=sys.stderr)
    failed = [c for c in results["cells"] if c["status"] == "failed"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m bigbatch.study ...` (the same as `bigbatch study ...`)."""
    parser = argparse.ArgumentParser(prog="bigbatch study", description=__doc__.splitlines()[0])
    add_study_arguments(parser)
    return run_study_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
