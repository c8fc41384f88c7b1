"""What rank 0 shows and writes while training: a progress bar, metrics.jsonl, TensorBoard."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; null keeps a line parseable by strict readers.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per line to `OUT/metrics.jsonl` and mirrors scalars to TensorBoard.

    On resume, lines past the checkpoint's step are dropped first: they belong to
    the part of the interrupted run that is about to be redone.
    """

    def __init__(self, out: Path, *, tensorboard: bool | None = None, resume_step: int | None = None,
                 files: Any = None):
        """`files` (a `bigbatch.train.outdir.RunFiles`) records what this writes."""
        self.path = Path(out) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if files is not None:
            files.add(self.path)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines()
                if line.strip() and _step_of(line) <= resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file: TextIO = open(self.path, "a")  # noqa: SIM115 - open for the run's lifetime
        self._tb = None
        if tensorboard is not False:
            logdir = Path(out) / TENSORBOARD_DIR
            before = set(logdir.iterdir()) if logdir.is_dir() else set()
            if files is not None:
                files.make_dir(TENSORBOARD_DIR)
            self._tb = _summary_writer(logdir, resume_step)
            if files is not None and logdir.is_dir():  # the event file it just opened
                files.add(*(set(logdir.iterdir()) - before))

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._tb is not None:
            kind = record.get("kind", "train")
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", math.inf))
    except (ValueError, AttributeError, TypeError):  # a foreign line: dropped on resume
        return math.inf


def _summary_writer(logdir: Path, resume_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard not installed (or broken): event files are optional
        return None
    # purge_step discards events past the checkpoint when a resumed run rewrites them.
    return SummaryWriter(str(logdir), purge_step=resume_step)


def count(value: float) -> str:
    """A step count as people write it: `1`, not `1.0` (a fractional one keeps 2 decimals)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


def tidy(value: float) -> str:
    """An epoch count to two decimals at most: `2.22`, `16`, `0.5`."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


class ProgressBar:
    """A rich progress bar on a terminal; plain lines (one per update) otherwise.

    `enabled=False` (workers other than rank 0) shows nothing at all; `bar=False`
    keeps messages but drops the per-step updates.
    """

    def __init__(self, total_steps: int, initial_step: int = 0, *, enabled: bool = True,
                 bar: bool = True, live: bool | None = None, stream: TextIO | None = None):
        self.enabled = enabled
        self.show_steps = enabled and bar
        self.stream = stream if stream is not None else sys.stderr
        self.total = total_steps
        live = self.stream.isatty() if live is None else live
        self._bar = None
        if self.show_steps and live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, completed=initial_step, info="")
            self._bar.start()

    def update(self, step: int, *, epoch: float, loss: float, lr: float, samples_per_s: float) -> None:
        if not self.show_steps:
            return
        info = f"epoch {epoch:.2f} loss {loss:.4f} lr {lr:.4g} {samples_per_s:,.0f} samples/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        else:
            print(f"step {count(step)}/{count(self.total)} {info}", file=self.stream, flush=True)

    def print(self, message: str) -> None:
        """A line that does not tear the bar (shown even when step updates are off)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(message, highlight=False, markup=False)
        else:
            print(message, file=self.stream, flush=True)

    def result(self, line: str) -> None:
        """The run's result line: on stdout, so that `bigbatch train ... > result.txt` keeps
        it (everything else, progress included, is on stderr)."""
        self.close()
        if self.enabled:
            print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def reference(recipe: Any, epochs: float, metric: str) -> dict[str, Any] | None:
    """The small-batch baseline of the same epochs, when one was measured."""
    if recipe.reference is None or abs(epochs - recipe.epochs) > 1e-6:
        return None
    return {"global_batch_size": recipe.base_batch_size, "lr": recipe.base_lr,
            "optimizer": recipe.optimizer, "epochs": recipe.epochs,
            f"test_{metric}": recipe.reference, "note": recipe.reference_note}


def closing_line(s: dict[str, Any]) -> str:
    metric = s["metric"]
    value = s[f"test_{metric}"]
    shown = f"{100 * value:.2f}%" if metric == "accuracy" else f"{value:.4f}"
    ps = s.get("parameter_server")
    ranks = (f"{ps['servers']} server(s) + {ps['workers']} worker(s)" if ps
             else f"{s['world_size']} worker(s)")
    steps = f" in {s['steps']} steps" if s.get("steps") else ""
    changes = s.get("batch_size_changes") or []
    batch = (f"{changes[0]['old']} -> {s['global_batch_size']}" if changes
             else s["global_batch_size"])
    line = (f"test {metric} {shown} after {tidy(s['epochs'])} epochs{steps} at global batch "
            f"{batch} ({s['optimizer']}, {ranks}, {s['wall_time_s']:.0f} s)")
    ref = s["reference"]
    if ref is not None:
        r = ref[f"test_{metric}"]
        rs = f"{100 * r:.2f}%" if metric == "accuracy" else f"{r:.4f}"
        # The same epochs: about this run's samples in steps of the baseline's batch.
        theirs = (f", about {round(s['samples'] / ref['global_batch_size'])} steps"
                  if s.get("samples") else "")
        line += (f"; small-batch baseline: {rs} at batch {ref['global_batch_size']} "
                 f"({ref['optimizer']}, same epochs{theirs})")
    else:
        line += "; no small-batch baseline measured for these epochs"
    return line
