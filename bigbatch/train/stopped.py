"""`OUT/stopped.json`: why a policy ended the run, for the launcher on the other side of
torchrun (which turns any worker's exit status into its own 1)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bigbatch.train.checkpoint import write_text_atomic

__all__ = ["STOPPED_FILE", "read_stopped", "write_stopped"]

STOPPED_FILE = "stopped.json"


def write_stopped(out: str | os.PathLike, message: str, status: int, step: int,
                  files: Any = None) -> None:
    """Rank 0: record the stop (`files`, the run's `RunFiles`, lists the file first)."""
    path = Path(out) / STOPPED_FILE
    if files is not None:
        files.add(path)
    write_text_atomic(path, json.dumps({"message": message, "status": int(status),
                                        "step": int(step)}) + "\n")


def read_stopped(out: str | os.PathLike, since: float) -> tuple[str, int] | None:
    """(message, status) of a stop written at or after `since` (a `time.time()`), else None."""
    path = Path(out) / STOPPED_FILE
    try:
        if path.stat().st_mtime < since:
            return None
        data = json.loads(path.read_text())
        return str(data["message"]), int(data["status"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
