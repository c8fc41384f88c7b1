"""Atomic, verified checkpoints: save and resume everything stateful in a training run.

`save_checkpoint` writes `checkpoints/step-N.pt` (temporary file, fsync, rename),
then its manifest `step-N.json` (size and sha256 of the payload), the commit
point, and keeps the newest K. `latest_checkpoint` returns the newest checkpoint
whose payload matches its manifest: a corrupt or truncated one is skipped with
a one-line warning and the previous good one is used. A payload without a
manifest (a crash between the two renames, or an older run) is accepted when
its zip structure and CRCs check out. A save that fails midway (disk full: torch
reports it as a RuntimeError) leaves the previous checkpoints intact, removes its
temporary file and raises `CheckpointSaveError`. A payload torch cannot read is a
one-line `CheckpointError`; `load_training_checkpoint` also checks its format (a
foreign, older or newer payload is one too).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigbatch.errors import ConfigError
from bigbatch.train.sharded import remove_sharded, sharded_dir, sharded_problem

log = logging.getLogger(__name__)
MANIFEST_FORMAT = 1
CHECKPOINT_FORMAT = 2
"""Format of the payload `bigbatch.train.trainer` saves. 1: 0.1.0's, the weights in
"model"; 2 adds sharded runs, whose payload says "sharded" and whose weights and
optimizer state are DCP shards beside it (`bigbatch.train.sharded`)."""
_PAYLOAD_KEYS = ("step", "engine", "sampler", "rng")
# A parameter-server checkpoint keeps each worker's sampler and RNG inside this entry.
_PS_PAYLOAD_KEYS = ("step", "engine", "parameter_server")


class WriteError(OSError):
    """An output file could not be written (the message says which, and why)."""


class CheckpointSaveError(WriteError):
    """A checkpoint could not be written; the previous ones are intact."""


class CheckpointError(ConfigError):
    """A checkpoint that this version cannot resume from (foreign, older, newer, unreadable)."""


def failure_reason(e: BaseException) -> str:
    """Why a write failed, in a few words (torch.save's RuntimeError does not say)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def atomic_save(obj, path: str | os.PathLike) -> None:
    """`torch.save` to a temporary file beside `path`, fsync, then rename over `path`.

    A reader (or a resume after a crash) sees either the old file or the new one,
    never a torn write.
    """
    _atomic_write(path, lambda f: torch.save(obj, f), "wb")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """`text` to `path` the same way: the old file or the new one, never a torn write."""
    _atomic_write(path, lambda f: f.write(text), "w")


def _atomic_write(path: str | os.PathLike, write: Any, mode: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except RuntimeError as e:  # torch.save's "file write failed": say why, while it is true
        if _disk_full(path.parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _disk_full(directory: Path) -> bool:
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


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


def manifest_path(path: str | os.PathLike) -> Path:
    """The manifest beside checkpoint payload `path`."""
    return Path(path).with_suffix(".json")


def list_checkpoints(out: str | os.PathLike) -> list[Path]:
    """Checkpoint payloads in `out`, oldest first (temporary files are never listed;
    not verified: see `latest_checkpoint`)."""
    d = Path(out) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        stem = p.name.removeprefix(_PREFIX).removesuffix(_SUFFIX)
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX) and stem.isdigit():
            found.append((int(stem), p))
    return [p for _, p in sorted(found)]


def _sha256(path: Path) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None when the payload at `path` is whole, else why not (one short phrase)."""
    path = Path(path)
    manifest = manifest_path(path)
    if sharded_dir(path).exists() and (problem := sharded_problem(path)):
        return problem
    try:
        if manifest.exists():
            meta = json.loads(manifest.read_text())
            digest, size = _sha256(path)
            if size != meta["bytes"]:
                return f"truncated: {size} bytes, manifest says {meta['bytes']}"
            if digest != meta["sha256"]:
                return "checksum mismatch"
            return None
        with zipfile.ZipFile(path) as z:  # no manifest: torch.save's zip and its CRCs
            bad = z.testzip()
        return f"damaged entry {bad}" if bad else None
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        return f"unreadable ({type(e).__name__}: {e})".splitlines()[0]


_warned: set[tuple[str, str]] = set()


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    """The newest checkpoint that verifies; a bad newer one is skipped with a warning."""
    found = list_checkpoints(out)
    for i in range(len(found) - 1, -1, -1):
        problem = verify_checkpoint(found[i])
        if problem is None:
            return found[i]
        key = (str(found[i]), problem)
        if key not in _warned:  # resolve, preflight and the trainer all ask: say it once
            _warned.add(key)
            fallback = next((p.name for p in reversed(found[:i]) if verify_checkpoint(p) is None),
                            None)
            log.warning("warning: checkpoint %s is corrupt (%s); %s", found[i].name, problem,
                        f"using {fallback}" if fallback else "no older good checkpoint")
    return None


def save_checkpoint(out: str | os.PathLike, step: int, state: dict, keep: int = 2,
                    files: Any = None) -> Path:
    """Write `state` as the checkpoint of `step` atomically with its manifest; keep the
    newest `keep` ones. Raises `CheckpointSaveError` (older checkpoints intact) on failure.

    `files` (a `bigbatch.train.outdir.RunFiles`) records the files before they are
    written; with it only recorded checkpoints are pruned.
    """
    path = checkpoint_path(out, step)
    manifest = manifest_path(path)
    existed = path.exists()  # a step saved again: its old payload stays the fallback
    try:
        if files is not None:
            files.make_dir(CHECKPOINT_DIR)
            files.add(path, manifest)
        manifest.unlink(missing_ok=True)  # a half-replaced step must not verify against it
        atomic_save(state, path)
        digest, size = _sha256(path)
        write_text_atomic(manifest, json.dumps(
            {"format": MANIFEST_FORMAT, "step": step, "payload": path.name, "bytes": size,
             "sha256": digest}))  # the commit point
    except (OSError, RuntimeError, pickle.PicklingError) as e:
        if not existed and not manifest.exists():  # never committed: no half-saved step
            path.unlink(missing_ok=True)
        previous = [p.name for p in list_checkpoints(out) if p != path]
        raise CheckpointSaveError(
            f"saving checkpoint {path.name} failed ({failure_reason(e)}); "
            f"{'kept ' + previous[-1] if previous else 'no earlier checkpoint'}"
        ) from e
    old = list_checkpoints(out)[:-keep] if keep > 0 else []
    if files is not None:
        old = [p for p in old if files.owns(p.relative_to(out).as_posix())]
    for p in old:
        p.unlink(missing_ok=True)
        manifest_path(p).unlink(missing_ok=True)
        remove_sharded(p, files)  # the DCP shards of a sharded step (a directory DCP wrote)
    if files is not None and old:
        files.discard(*old, *map(manifest_path, old))
    return path


def load_checkpoint(path: str | os.PathLike) -> Any:
    """Load a checkpoint written by `save_checkpoint` (our own files: full unpickling).

    Raises `CheckpointError` (one line) for a payload torch cannot read.
    """
    path = Path(path)
    try:
        # weights_only=False: the RNG states hold numpy arrays and python tuples.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch, zipfile, pickle and the classes a foreign pickle names
        raise CheckpointError(f"checkpoint {path} cannot be read: "
                              f"{type(e).__name__}: {failure_reason(e)}") from None


def load_training_checkpoint(path: str | os.PathLike) -> dict:
    """`load_checkpoint` of a training checkpoint: CheckpointError unless it is one, of a
    format this version reads."""
    ckpt = load_checkpoint(path)
    check_format(ckpt, path)
    return ckpt


def check_format(ckpt: Any, path: str | os.PathLike) -> None:
    """CheckpointError unless `ckpt` is a training checkpoint of a format this version reads."""
    name = Path(path).name
    if not isinstance(ckpt, dict) or "engine" not in ckpt or not (
            "model" in ckpt or ckpt.get("sharded")):
        what = type(ckpt).__name__
        if isinstance(ckpt, dict):
            what += f" with keys {', '.join(map(str, list(ckpt)[:4])) or 'none'}"
        raise CheckpointError(f"checkpoint {name} is not a bigbatch training checkpoint (a {what})")
    fmt = ckpt.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise CheckpointError(f"checkpoint {name} has format {fmt!r}, from a bigbatch before "
                              f"0.1.0; this version reads format {CHECKPOINT_FORMAT}")
    if fmt > CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {name} has format {fmt}, from a newer bigbatch; "
                              f"this version reads format {CHECKPOINT_FORMAT}")
    keys = _PS_PAYLOAD_KEYS if "parameter_server" in ckpt else _PAYLOAD_KEYS
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {name} is incomplete: no {', '.join(missing)}")
