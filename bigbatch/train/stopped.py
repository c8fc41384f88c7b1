"""`OUT/stopped.json`: why a policy ended the run, for the launcher on the other side of
torchrun (which turns any worker's exit status into its own 1), and, when a policy asked
for one (`Policies.request_relaunch`), the strategy keys to resume with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bigbatch.train.checkpoint import write_text_atomic

__all__ = ["STOPPED_FILE", "read_stopped", "take_relaunch", "write_stopped"]

STOPPED_FILE = "stopped.json"


def write_stopped(out: str | os.PathLike, message: str, status: int, step: int,
                  files: Any = None, relaunch: dict[str, Any] | None = None) -> None:
    """Rank 0: record the stop (`files`, the run's `RunFiles`, lists the file first);
    `relaunch`: the strategy keys a policy asked the run to resume with."""
    path = Path(out) / STOPPED_FILE
    if files is not None:
        files.add(path)
    record = {"message": message, "status": int(status), "step": int(step)}
    if relaunch:
        record["relaunch"] = dict(relaunch)
    write_text_atomic(path, json.dumps(record) + "\n")


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


def take_relaunch(out: str | os.PathLike, since: float) -> tuple[dict[str, Any], int] | None:
    """(strategy keys, step) of a relaunch asked for in a stop written at or after `since`;
    the launcher that takes it marks it taken (``relaunched``), so it is followed once."""
    path = Path(out) / STOPPED_FILE
    try:
        if path.stat().st_mtime < since:
            return None
        data = json.loads(path.read_text())
        keys = data.pop("relaunch", None)
        if not isinstance(keys, dict) or not keys:
            return None
        data["relaunched"] = keys
        write_text_atomic(path, json.dumps(data) + "\n")
        return {str(k): v for k, v in keys.items()}, int(data["step"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
