"""`run.save_state(dir)` / `run.load_state(dir)`: a whole run's state for your own loop.

A state directory holds what resuming needs, whatever the layout:

- ``model/`` and the optimizer through `torch.distributed.checkpoint` (DCP) when the
  run's tensors are sharded or sliced (FSDP2, tensor or pipeline parallelism): every
  rank writes its shards, and a load on another world size or degree reads back the
  slices it now owns; otherwise ``model.pt`` (rank 0) with the whole model;
- ``run.pt`` (rank 0): `run.state_dict()` (LR clock, merge window, loss scaler, batch,
  adaptive and policy state; the optimizer too when unsharded) and your ``extra`` dict;
- ``rng-R.pt``: rank R's random-number generators (restored when the world is the same);
- ``bigbatch-state.json``, written last: the commit point.

The directory is written beside its final name and renamed into place, so a crash
mid-save leaves the previous state whole. An existing directory is replaced only if
it is a state bigbatch wrote (it holds ``bigbatch-state.json``): nothing else is removed.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigbatch.engine.safe_load import check_plain
from bigbatch.errors import ConfigError, SaveStateError, UntrustedFileError
from bigbatch.parallel.random_state import numpy_state, numpy_tuple

try:
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # a torch without DCP
    CheckpointException = OSError  # type: ignore[misc,assignment]

__all__ = ["dcp_options", "failure_reason", "dcp_state", "load_state", "rng_state", "save_state",
           "set_dcp_state", "set_rng_state", "whole_state_dict"]

MARKER = "bigbatch-state.json"
FORMAT = 1


def dcp_options() -> Any:
    """The state-dict options every DCP save and load of bigbatch uses: optimizer state
    keyed by parameter name, not by group index (pipeline stages' groups share indices
    but not parameters, and DCP keeps one value per key)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def dcp_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model", "optimizer"}`` state dicts of this rank's shards, for `dcp.save` and
    `dcp.load` (`save_state` and the trainer's sharded checkpoints)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(module, optimizer, options=dcp_options())
    return {"model": model, "optimizer": optim}


def set_dcp_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  state: dict[str, Any]) -> None:
    """Put a `dcp_state` that `dcp.load` filled back into the module and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=dcp_options())


def rng_state() -> dict:
    """This process's random-number generator states: torch (CPU and CUDA), numpy, python,
    as tensors and plain data (read back weights-only: `bigbatch.engine.safe_load`)."""
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state(np.random.get_state()),
             "python": [int(version), [int(x) for x in internal], gauss_next]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned (or, before RNG states were plain data, the
    tuples of numpy's and python's own getstate)."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_tuple(state["numpy"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _agree(run: Any, failure: BaseException | None, what: str) -> None:
    """Collective: raise `SaveStateError` on every rank if `failure` happened on any,
    naming the lowest rank that failed (DCP tells every rank which ones did)."""
    from bigbatch.parallel.world import gather

    mine = None
    if failure is not None:
        failed = getattr(failure, "failures", None)
        rank = min(failed) if isinstance(failed, dict) and failed else run.world.rank
        mine = (rank, failure_reason(failure))
    bad = sorted(f for f in gather(mine, run.world) if f is not None)
    if bad:
        rank, why = bad[0]
        raise SaveStateError(f"{what} failed on rank {rank} ({why}); the previous state, if "
                             "any, is kept") from failure


def failure_reason(e: BaseException) -> str:
    """Why a write or read failed, in a few words (torch.save's RuntimeError does not say;
    DCP's CheckpointException: its lowest failed rank's error)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        e = inner[0] if isinstance(inner, tuple) else inner
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def save_state(run: Any, directory: str | os.PathLike, extra: dict[str, Any] | None = None
               ) -> Path:
    """Collective (every rank calls it): write `run`'s state and `extra` to `directory`.
    A failure on any rank (a full disk) raises `SaveStateError` on every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = Path(directory)
    if final.exists() and not (final / MARKER).is_file():
        raise ConfigError(f"run.save_state({str(final)!r}): the directory exists and is not "
                          "a state bigbatch wrote; choose another (nothing was written)")
    foreign = _not_written(final) if final.exists() else None
    if foreign is not None:  # replacing the state would delete it
        raise ConfigError(f"run.save_state({str(final)!r}): it holds {foreign}, which "
                          "bigbatch did not write; move it, or choose another directory "
                          "(nothing was written)")
    world, sharded = run.world, run.mesh.degrees.sharded_state
    what = f"run.save_state({str(final)!r})"
    check_plain(dict(extra or {}), f"{what}: extra")
    tmp = final.with_name(f".{final.name}.tmp")
    failure: BaseException | None = None
    if world.is_main:
        try:
            _remove_leftover(tmp)  # of an interrupted save; another program's is refused
            tmp.mkdir(parents=True)
            (tmp / MARKER).write_text("{}\n")  # ours from now on (the real one comes last)
        except OSError as e:
            failure = e
    _agree(run, failure, what)
    engine = run.state_dict()  # collective under ZeRO-1 (the optimizer gathers to rank 0)
    try:
        if sharded:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(dcp_state(run.module, run.optimizer), checkpoint_id=tmp / "model",
                         no_dist=not dist.is_initialized())
        torch.save(rng_state(), tmp / f"rng-{world.rank}.pt")
        if world.is_main:
            if not sharded:
                torch.save(run.module.state_dict(), tmp / "model.pt")
            saved = {"engine": engine, "extra": dict(extra or {})}
            check_plain(saved, "the run's state")  # a policy's state_dict, say
            torch.save(saved, tmp / "run.pt")
    # torch reports a full disk as RuntimeError, DCP as CheckpointException (a BaseException)
    except (OSError, RuntimeError, CheckpointException, ConfigError) as e:
        failure = e
    try:
        _agree(run, failure, what)
    except SaveStateError:
        if world.is_main:
            _remove_folder(tmp)
        raise
    old = final.with_name(f".{final.name}.old")
    if world.is_main:
        try:
            (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "step": run.step,
                                                  "world_size": world.world_size,
                                                  "sharded": sharded,
                                                  "files": _files_in(tmp)}) + "\n")
            if final.exists():
                _remove_leftover(old)  # a state a crash left there; not another program's
                os.replace(final, old)
            os.replace(tmp, final)
            _remove_folder(old)  # the previous state: only bigbatch's files (checked above)
        except OSError as e:
            failure = e
            if old.exists() and not final.exists():
                os.replace(old, final)
            _remove_folder(tmp)
    _agree(run, failure, what)
    return final


def _files_in(folder: Path) -> list[str]:
    """Every file under `folder`, relative to it ('/'-separated), symlinks not followed."""
    found = []
    for d, dirs, names in os.walk(folder):
        rel = Path(d).relative_to(folder)
        found += [(rel / n).as_posix() for n in names]
        found += [(rel / n).as_posix() for n in dirs if os.path.islink(os.path.join(d, n))]
    return sorted(found)


def _not_written(state: Path) -> str | None:
    """The first file in a saved `state` that its record does not list (another program's),
    else None. A state saved before the record listed its files: None (all its own)."""
    try:
        listed = json.loads((state / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(listed, list):
        return None
    return next((f for f in _files_in(state) if f not in {*listed, MARKER}), None)


def _remove_leftover(tmp: Path) -> None:
    """Delete what an interrupted save left at `tmp`: only a folder bigbatch made (it holds
    the marker from its first moment); anything else there raises FileExistsError."""
    if not (tmp.exists() or tmp.is_symlink()):
        return
    if tmp.is_symlink() or not tmp.is_dir() or not (tmp / MARKER).is_file():
        raise FileExistsError(errno.EEXIST, f"{tmp} exists and bigbatch did not make it; "
                              "move it away")
    _remove_folder(tmp)


def _remove_folder(folder: Path) -> None:
    """Delete a folder save_state made; a symlink in its place: the link, never its target
    (`shutil.rmtree` removes links inside without following them)."""
    if folder.is_symlink():
        folder.unlink(missing_ok=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)


def load_state(run: Any, directory: str | os.PathLike) -> dict[str, Any]:
    """Collective: restore what `save_state` wrote into `run`; returns the `extra` dict.
    Every file is read as tensors and plain data only (`bigbatch.engine.safe_load`): one
    that holds anything else raises `UntrustedFileError` before the run is changed."""
    from bigbatch.engine.safe_load import dcp_load, load_plain, read_dcp_metadata

    path = Path(directory)
    where = f"run.load_state({str(path)!r})"
    if not (path / MARKER).is_file():
        raise ConfigError(f"{where}: no state saved there ({MARKER} is missing)")
    try:
        meta = json.loads((path / MARKER).read_text())
        saved_sharded, saved_world = bool(meta["sharded"]), int(meta["world_size"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{where}: {MARKER} is not a state record ({type(e).__name__})"
                          ) from None
    sharded = run.mesh.degrees.sharded_state
    if saved_sharded != sharded:
        raise ConfigError(f"{where}: saved by a "
                          f"{'sharded' if saved_sharded else 'whole-model'} run; this run "
                          f"is {'sharded' if sharded else 'not'} (the layout must agree)")
    saved: Any = None
    rngs: Any = None
    model, refused = None, None
    try:
        saved = load_plain(path / "run.pt", f"{where}: run.pt")
        if not isinstance(saved, dict) or not isinstance(saved.get("engine"), dict):
            raise ConfigError(f"{where}: run.pt is not a run state (a {type(saved).__name__})")
        rng = path / f"rng-{run.world.rank}.pt"
        if saved_world == run.world.world_size and rng.is_file():
            rngs = load_plain(rng, f"{where}: {rng.name}")
        if sharded:  # DCP's index, checked here: inside DCP a refusal loses its words
            read_dcp_metadata(path / "model" / ".metadata", f"{where}: model/.metadata")
        else:
            model = load_plain(path / "model.pt", f"{where}: model.pt",
                               map_location=run.world.device)
    except ConfigError as e:
        refused = e
    _refuse_together(run, refused)
    if sharded:
        state = dcp_state(run.module, run.optimizer)
        dcp_load(state, path / "model")
        set_dcp_state(run.module, run.optimizer, state)
    else:
        run.module.load_state_dict(model)
    run.load_state_dict(saved["engine"])
    if rngs is not None:
        set_rng_state(rngs)
    return saved.get("extra", {})


def _refuse_together(run: Any, refused: ConfigError | None) -> None:
    """Collective: every rank raises the lowest refusing rank's error (before any of them
    enters DCP's collective load), or none does."""
    from bigbatch.parallel.world import gather

    said = [m for m in gather(None if refused is None else str(refused), run.world)
            if m is not None]
    if refused is not None:
        raise refused
    if said:
        raise UntrustedFileError(said[0])


def whole_state_dict(run: Any) -> dict[str, torch.Tensor]:
    """Collective: the whole model's state dict as plain CPU tensors on rank 0 (other ranks
    get what they gathered or an empty dict), vocabulary padding taken off: what the
    unsplit model loads, e.g. for a Hugging Face ``save_pretrained``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from bigbatch.parallel.tensor_parallel import is_padded, unpadded_state_dict

    if run.pipeline is not None:
        raise ConfigError("run.whole_state_dict() under [pipeline]: each rank holds one "
                          "stage; save with run.save_state() and load it into one process")
    if is_padded(run.module):
        return {k: v.cpu() for k, v in unpadded_state_dict(run.module).items()}
    state = get_model_state_dict(run.module, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    return {k: v.cpu() for k, v in state.items()}
