"""Overall progress of `bigbatch study`: one bar over all cells, in epochs trained.

The running cell's position comes from the last line of its `metrics.jsonl`,
polled by a thread, so the same display works for in-process and launched cells.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO


def last_epoch(metrics: Path) -> float:
    """Epoch of the last complete line of a metrics.jsonl (0 when none yet)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0.0
    for line in reversed(lines):
        try:
            return float(json.loads(line).get("epoch", 0.0))
        except (ValueError, AttributeError, TypeError):
            continue
    return 0.0


class StudyProgress:
    """A rich bar on a terminal, else (or with `bar=False`) one line per cell start and end;
    `enabled=False` shows nothing."""

    def __init__(self, cells: list[Any], epochs: float, *, enabled: bool = True, bar: bool = True,
                 stream: TextIO | None = None, poll_s: float = 0.5):
        self.stream = stream if stream is not None else sys.stderr  # before any redirect
        self.enabled, self.epochs, self.n = enabled, float(epochs), len(cells)
        self.finished, self.index, self.poll_s = 0.0, 0, poll_s
        self.cell: Any = None
        self.t0 = time.perf_counter()
        self._bar = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if enabled and bar and self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("[bold]study"), BarColumn(bar_width=30),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 TimeRemainingColumn(), console=Console(file=self.stream))
            self._task = self._bar.add_task("study", total=self.n * self.epochs, info="")

    def __enter__(self) -> StudyProgress:
        if self._bar is not None:
            self._bar.start()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._bar is not None:
            self._bar.stop()

    def _label(self, cell: Any) -> str:
        return f"cell {self.index}/{self.n} {cell.name} @ {cell.batch} seed {cell.seed}"

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            cell = self.cell
            if cell is None:
                continue
            epoch = min(last_epoch(cell.dir / "metrics.jsonl"), self.epochs)
            self._bar.update(self._task, completed=self.finished + epoch,
                             info=f"{self._label(cell)} epoch {epoch:.1f}/{self.epochs:g}")

    def start(self, cell: Any) -> None:
        self.index += 1
        self.cell = cell
        if self.enabled and self._bar is None:
            print(f"study: {self._label(cell)} ({cell.dir})", file=self.stream, flush=True)

    def done(self, cell: Any, record: dict[str, Any]) -> None:
        self.cell = None
        self.finished += self.epochs
        line = f"{self._label(cell)}: {record['status']} in {record.get('run_wall_s', 0):.0f} s"
        if "error" in record:
            line += f" ({record['error']})"
        if self._bar is not None:
            self._bar.update(self._task, completed=self.finished, info=line)
            self._bar.console.print(line, highlight=False, markup=False)
        elif self.enabled:
            print(f"study: {line}", file=self.stream, flush=True)
