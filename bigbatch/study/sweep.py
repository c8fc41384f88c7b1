"""`bigbatch study`: a batch-size sweep at a fixed epoch budget, and its report.

Every (strategy, global batch, seed) cell trains the same task for the same number
of epochs (the same seed gives the same init and data order); each strategy scales one
small-batch recipe (the task's `Recipe`) by its own rule (`bigbatch.study.rules.RULES`),
and `"<strategy>@<schedule>"` grows its batch up to the cell's (`bigbatch.study.schedules`).
Each cell writes the usual `train` outputs under `OUT/cells/<strategy>-b<batch>[-s<seed>]/`
(`schedules.dir_name`); the study then reads their
`metrics.jsonl` / `summary.json` and writes `OUT/report.md`, `OUT/results.json`
and PNG figures (`bigbatch.study.report`). The strategies and their rules are in
`bigbatch.study.rules`.

A finished cell (its `summary.json` present and its `study_cell.json` equal to
what the cell would be now) is kept on restart; an interrupted one resumes from
its last checkpoint. Cells run one after another: in this process (`nproc=1`,
calling `train()`), or through `python -m bigbatch train --nproc N`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.study.config import StudyConfig
from bigbatch.study.rules import _warmup_epochs, cell_strategy
from bigbatch.study.schedules import NoGrowth, dir_name

CELL_FILE, PENDING_FILE, CELL_STRATEGY = "study_cell.json", "study_pending.json", "study_strategy.toml"

# ----------------------------------------------------------------- the cells


@dataclass
class Cell:
    """One (strategy, global batch, seed) run; `batch` is the ceiling of a growing one."""

    name: str
    batch: int
    dir: Path
    strategy: Any
    spec: dict[str, Any]
    seed: int = 0


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


def build_cells(c: StudyConfig, task: Any, recipe: Any,
                skipped: list[str] | None = None) -> list[Cell]:
    """Every cell, validated (batch arithmetic and schedule) before anything runs. A growing
    strategy's cell whose ceiling is not above its start is left out, and its reason
    appended to `skipped`."""
    from bigbatch.train.config import TrainConfig
    from bigbatch.train.plan import plan_run

    cells, out = [], Path(c.out) / "cells"
    for name in c.strategies:
        for batch in c.batches:
            try:
                s = cell_strategy(c, recipe, name, batch)
            except NoGrowth as e:
                if skipped is not None:
                    skipped.append(str(e))
                continue
            tc = TrainConfig(task=c.task, model=c.model, task_options=c.task_options,
                             epochs=c.epochs, seed=c.seed_list[0])
            sampler = plan_run(tc, s, task, c.nproc)[1]
            # Evaluations every so many steps of the first batch: a growing one's epochs
            # take fewer steps as it grows, and are evaluated less often.
            eval_every = max(1, sampler.steps_per_epoch // c.evals_per_epoch)
            for seed in c.seed_list:
                spec = {"task": c.task, "model": c.model, "task_options": c.task_options,
                        "epochs": c.epochs, "seed": seed, "nproc": c.nproc,
                        "eval_every": eval_every, "strategy": s.to_dict(),
                        "in_force": s.in_force()}
                spec = json.loads(json.dumps(spec))  # the form it has when read back
                cells.append(Cell(name, batch, out / dir_name(name, batch, seed), s, spec, seed))
    return cells


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _same_spec(stored: Any, spec: dict[str, Any]) -> bool:
    """`stored` (a cell file) describes `spec`'s run. The values unset keys take by
    family ("in_force") are compared too, so a changed default reruns the cells that
    used it; a cell file from before they were recorded is compared without them."""
    if isinstance(stored, dict) and "in_force" not in stored:
        spec = {k: v for k, v in spec.items() if k != "in_force"}
    return stored == spec


def is_finished(cell: Cell) -> bool:
    """The cell's outputs exist and were made by exactly this cell."""
    return ((cell.dir / "summary.json").is_file()
            and _same_spec(_read_json(cell.dir / CELL_FILE), cell.spec))


def _resumable(cell: Cell) -> bool:
    from bigbatch.train.checkpoint import latest_checkpoint

    return (_same_spec(_read_json(cell.dir / PENDING_FILE), cell.spec)
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


def _run_in_process(cell: Cell, resume: bool, threads: int | None = None) -> None:
    from bigbatch.train.trainer import TrainConfig, train

    spec = cell.spec
    config = TrainConfig(task=spec["task"], model=spec["model"], task_options=spec["task_options"],
                         epochs=spec["epochs"], seed=spec["seed"], out=str(cell.dir),
                         resume=resume, overwrite=not resume, progress=False, tensorboard=False,
                         keep_checkpoints=1,
                         eval_every=spec["eval_every"])
    with _isolated(), open(cell.dir / "train.log", "a") as log, contextlib.redirect_stderr(log):
        if threads:
            import torch

            torch.set_num_threads(threads)
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
    cmd += ["--eval-every", str(spec["eval_every"])]
    return cmd + (["--resume"] if resume else ["--overwrite"])  # the cell's own earlier try


def _run_subprocess(cell: Cell, resume: bool, threads: int | None = None) -> None:
    (cell.dir / CELL_STRATEGY).write_text(cell.strategy.to_toml())
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with open(cell.dir / "train.log", "a") as log:
        rc = subprocess.call(train_command(cell, resume), stdout=log, stderr=subprocess.STDOUT,
                             env=env)
    if rc != 0:
        raise RuntimeError(f"bigbatch train exited with status {rc} (see {cell.dir / 'train.log'})")


def run_cell(cell: Cell, threads: int | None = None) -> dict[str, Any]:
    """Train one cell (resuming an interrupted one); returns its status record."""
    cell.dir.mkdir(parents=True, exist_ok=True)
    resume = _resumable(cell)
    (cell.dir / CELL_FILE).unlink(missing_ok=True)
    (cell.dir / PENDING_FILE).write_text(json.dumps(cell.spec, indent=1) + "\n")
    t0 = time.perf_counter()
    try:
        (_run_in_process if cell.spec["nproc"] == 1 else _run_subprocess)(cell, resume, threads)
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
    from bigbatch.study import report as _report
    from bigbatch.study.progress import StudyProgress

    c, (task, recipe) = resolved(config)
    skipped: list[str] = []
    cells = build_cells(c, task, recipe, skipped)
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    # The command that trained the cells (a --report-only run keeps the previous one).
    previous = _read_json(out / "study.json") or {}
    command = shlex.join(["bigbatch", *argv]) if argv else None
    if not run_missing or command is None:
        command = previous.get("command", command)
        if c.threads is None and not run_missing:
            c.threads = previous.get("threads")
    (out / "study.json").write_text(json.dumps({**asdict(c), "command": command}, indent=2) + "\n")
    status: dict[str, dict[str, Any]] = {}
    todo = [cell for cell in cells if not is_finished(cell)]
    for cell in cells:
        if cell not in todo:
            status[cell.dir.name] = {"status": "kept"}
    if run_missing and todo:
        with StudyProgress(todo, c.epochs, bar=c.progress) as progress:
            for cell in todo:
                progress.start(cell)
                status[cell.dir.name] = record = run_cell(cell, c.threads)
                progress.done(cell, record)
    elif todo:
        for cell in todo:
            status[cell.dir.name] = {"status": "missing"}
    results = _report.collect(c, task, recipe, cells, status, command=command, skipped=skipped)
    _report.write(results, out)
    return results


