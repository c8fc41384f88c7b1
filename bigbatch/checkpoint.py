"""Atomic checkpoints: save and resume everything stateful in a training run."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
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


CHECKPOINT_DIR = "checkpoints"
_PREFIX, _SUFFIX = "step-", ".pt"


def rng_state() -> dict:
    """This process's random-number generator states: torch (CPU and CUDA), numpy, python."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_path(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / CHECKPOINT_DIR / f"{_PREFIX}{step:09d}{_SUFFIX}"


def list_checkpoints(out: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `out`, oldest first (temporary files are never listed)."""
    d = Path(out) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        stem = p.name.removeprefix(_PREFIX).removesuffix(_SUFFIX)
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX) and stem.isdigit():
            found.append((int(stem), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def save_checkpoint(out: str | os.PathLike, step: int, state: dict, keep: int = 2) -> Path:
    """Write `state` as the checkpoint of `step` atomically; keep the newest `keep` ones."""
    path = checkpoint_path(out, step)
    atomic_save(state, path)
    for old in list_checkpoints(out)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint written by `save_checkpoint` (our own files: full unpickling)."""
    # weights_only=False: the RNG states hold numpy arrays and python tuples.
    return torch.load(path, map_location="cpu", weights_only=False)
