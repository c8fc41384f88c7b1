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

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigbatch.errors import ConfigError

__all__ = ["load_state", "save_state", "whole_state_dict"]

MARKER = "bigbatch-state.json"
FORMAT = 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _dcp_state(run: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # Optimizer state keyed by parameter name: stages' groups share indices, not parameters.
    model, optim = get_state_dict(run.module, run.optimizer,
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": model, "optimizer": optim}


def _rng() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(run: Any, directory: str | os.PathLike, extra: dict[str, Any] | None = None
               ) -> Path:
    """Collective (every rank calls it): write `run`'s state and `extra` to `directory`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = Path(directory)
    if final.exists() and not (final / MARKER).is_file():
        raise ConfigError(f"run.save_state({str(final)!r}): the directory exists and is not "
                          "a state bigbatch wrote; choose another (nothing was written)")
    world, sharded = run.world, run.mesh.degrees.sharded_state
    tmp = final.with_name(f".{final.name}.tmp")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from an interrupted save
        tmp.mkdir(parents=True)
    _barrier()
    engine = run.state_dict()  # collective under ZeRO-1 (the optimizer gathers to rank 0)
    if sharded:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_dcp_state(run), checkpoint_id=tmp / "model",
                     no_dist=not dist.is_initialized())
    torch.save(_rng(), tmp / f"rng-{world.rank}.pt")
    _barrier()
    if world.is_main:
        if not sharded:
            torch.save(run.module.state_dict(), tmp / "model.pt")
        torch.save({"engine": engine, "extra": dict(extra or {})}, tmp / "run.pt")
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "step": run.step,
                                              "world_size": world.world_size,
                                              "sharded": sharded}) + "\n")
        old = final.with_name(f".{final.name}.old")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_state(run: Any, directory: str | os.PathLike) -> dict[str, Any]:
    """Collective: restore what `save_state` wrote into `run`; returns the `extra` dict."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(directory)
    if not (path / MARKER).is_file():
        raise ConfigError(f"run.load_state({str(path)!r}): no state saved there "
                          f"({MARKER} is missing)")
    meta = json.loads((path / MARKER).read_text())
    sharded = run.mesh.degrees.sharded_state
    if bool(meta["sharded"]) != sharded:
        raise ConfigError(f"run.load_state({str(path)!r}): saved by a "
                          f"{'sharded' if meta['sharded'] else 'whole-model'} run; this run "
                          f"is {'sharded' if sharded else 'not'} (the layout must agree)")
    saved = torch.load(path / "run.pt", map_location="cpu", weights_only=False)
    if sharded:
        state = _dcp_state(run)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path / "model", no_dist=not dist.is_initialized())
        set_state_dict(run.module, run.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
    else:
        run.module.load_state_dict(torch.load(path / "model.pt", map_location=run.world.device))
    run.load_state_dict(saved["engine"])
    rng = path / f"rng-{run.world.rank}.pt"
    if int(meta["world_size"]) == run.world.world_size and rng.is_file():
        _set_rng(torch.load(rng, weights_only=False))
    return saved["extra"]


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
