"""Atomic checkpoints: save and resume everything stateful in a training run."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def atomic_save(obj, path: str | os.PathLike) -> None:
    """`torch.save` to a temporary file beside `path`, fsync, then rename over `path`.

    A reader (or a resume after a crash) sees either the old file or the new one,
    never a torn write.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
