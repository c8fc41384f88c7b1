"""Sharded checkpoints: model and optimizer state through `torch.distributed.checkpoint`.

A run whose tensors are DTensors (FSDP2 sharding, tensor parallelism) saves its
model and optimizer state with DCP: every rank writes its own shards into
``checkpoints/step-N/`` and DCP records each tensor's global shape, so a resume
on another world size or sharding degree reads back the slices it now owns
(resharding). The small replicated rest (schedule, sampler, RNG states) stays in
``step-N.pt`` beside it, written by rank 0 after the shards: its manifest is the
checkpoint's commit point, as for an unsharded run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigbatch.engine.safe_load import dcp_load, read_dcp_metadata
from bigbatch.engine.saving import dcp_state, failure_reason, set_dcp_state
from bigbatch.errors import ConfigError, UntrustedFileError
from bigbatch.train.manifest import digest, file_problem, shard_entries, share

try:
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # a torch without DCP: nothing here runs
    CheckpointException = OSError  # type: ignore[misc,assignment]

__all__ = ["ShardedStateError", "check_sharded_fits", "is_dcp_file", "load_sharded",
           "remove_dcp_files", "remove_sharded", "save_sharded", "shard_problem",
           "sharded_dir", "sharded_problem", "temp_dir", "whole_model_state"]

log = logging.getLogger(__name__)
_METADATA = ".metadata"  # DCP's own index file, written last by its coordinator
# What DCP's file-system writer names its files: shards, the index, their temporaries.
_DCP_NAME = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?)$")


def sharded_dir(payload: str | os.PathLike) -> Path:
    """The DCP directory that belongs to checkpoint payload ``step-N.pt``."""
    payload = Path(payload)
    return payload.with_name(payload.name.removesuffix(".pt"))


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no group: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class ShardedStateError(OSError):
    """DCP could not save or load a checkpoint's shards (raised alike on every rank).

    `reason`: why, in a few words (the lowest failed rank's error); `where`: the folder."""

    everywhere = True  # every rank raises it: one of them says so

    def __init__(self, message: str, reason: str, where: Path) -> None:
        super().__init__(message)
        self.reason, self.where = reason, where


def temp_dir(final: Path) -> Path:
    """Where DCP writes the shards of `final` until they are complete."""
    return final.with_name(f".{final.name}.tmp")


def is_dcp_file(name: str) -> bool:
    """A file name DCP's file-system writer uses (shards, index, their temporaries)."""
    return _DCP_NAME.match(name) is not None


def remove_dcp_files(folder: Path, owns: Any = None) -> list[str]:
    """Delete the files DCP wrote in `folder` (those `owns(path)` accepts, when given), then
    the folder if it is empty. Returns the names of what stays (another program's files).
    A folder that is a symlink is not ours: nothing in it is deleted."""
    if folder.is_symlink():
        return [f"{folder.name} (a symlink)"]
    if not folder.is_dir():
        return []
    kept = []
    for p in sorted(folder.iterdir()):
        if p.is_file() and is_dcp_file(p.name) and (owns is None or owns(p)):
            p.unlink(missing_ok=True)
        else:
            kept.append(p.name)
    if not kept:
        with contextlib.suppress(OSError):
            folder.rmdir()
    return kept


def _all(obj: Any) -> list[Any]:
    """Every rank's `obj` (just this one without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(reason: str | None) -> str | None:
    """Collective: the first rank's failure (a few words), or None when no rank failed."""
    return next((r for r in _all(reason) if r is not None), None)


def _rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def save_sharded(payload: str | os.PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer, is_main: bool,
                 files: Any = None) -> dict[str, dict[str, Any]]:
    """Collective: write the model's and optimizer's shards for checkpoint `payload`.

    DCP writes into a temporary folder (recorded in `files`, rank 0's `RunFiles`, before
    anything is written there) that rank 0 renames once every rank has finished and
    hashed its share of the files. Returns, on rank 0, the size and sha256 of every file
    (keyed by its path relative to `checkpoints/`) for the manifest. A failure on any
    rank raises `ShardedStateError` on every rank, after rank 0 removed what the save
    wrote; the earlier checkpoints are untouched.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = sharded_dir(payload)
    tmp = temp_dir(final)
    rank, size = _rank_and_size()
    reason = None
    if is_main:
        try:
            if files is not None:
                files.add_temp_dir(tmp)  # recorded before anything is written in it
            remove_dcp_files(tmp)  # our own leftover from an interrupted save
        except OSError as e:
            reason = failure_reason(e)
    mine: dict[str, dict[str, Any]] = {}
    if _agree(reason) is None:  # (and every rank finds the folder clean)
        try:
            with _single_process_ok():
                meta = dcp.save(dcp_state(model, optimizer), checkpoint_id=tmp,
                                no_dist=not dist.is_initialized())
            names = sorted({i.relative_path for i in meta.storage_data.values()} | {_METADATA})
            mine = {name: digest(tmp / name) for name in share(names, rank, size)}
        except (CheckpointException, OSError, RuntimeError) as e:
            reason = failure_reason(e)
    parts = _all((mine, reason))
    reason = next((r for _, r in parts if r is not None), None)
    digests: dict[str, dict[str, Any]] = {}
    if reason is None and is_main:
        digests = {f"{final.name}/{k}": v for part, _ in parts for k, v in part.items()}
        try:
            _commit(tmp, final, files)
        except OSError as e:
            reason = failure_reason(e)
    reason = _agree(reason)
    if reason is not None:
        if is_main:
            with contextlib.suppress(OSError):
                remove_dcp_files(tmp)
                if files is not None:
                    files.discard_temp_dir(tmp)
        raise ShardedStateError(f"{tmp}: {reason}", reason, tmp.parent)
    return digests


def _commit(tmp: Path, final: Path, files: Any) -> None:
    """Rank 0: the shards in `tmp` become `final` (recorded first). A `final` of an
    earlier save of this step loses its DCP files; another program's files in it stay,
    and the new shards join them there."""
    new = sorted(p.name for p in tmp.iterdir() if is_dcp_file(p.name))
    if files is not None:
        files.add_dir(final, [final / name for name in new])
    owns = (lambda p: files.owns_path(p)) if files is not None else None
    if final.exists() and remove_dcp_files(final, owns):
        for name in sorted(new, key=lambda n: n == _METADATA):  # the index last
            os.replace(tmp / name, final / name)
        remove_dcp_files(tmp)
    else:
        os.replace(tmp, final)
    if files is not None:
        files.discard_temp_dir(tmp)


def load_sharded(payload: str | os.PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
    """Collective: load checkpoint `payload`'s shards into this rank's part of the
    model and optimizer, resharding when the mesh changed since the save. A read that
    fails on any rank (the shards were verified before: an I/O fault) raises
    `ShardedStateError` on every rank."""
    state = dcp_state(model, optimizer)
    folder = sharded_dir(payload)
    read_dcp_metadata(folder / _METADATA)  # refused here in its own words, not inside DCP
    try:
        dcp_load(state, folder)
    except (CheckpointException, OSError, RuntimeError) as e:
        why = failure_reason(e)
        raise ShardedStateError(f"loading checkpoint {folder.name}/ failed ({why})", why,
                                folder) from None
    set_dcp_state(model, optimizer, state)


def sharded_problem(payload: str | os.PathLike) -> str | None:
    """None when the DCP folder of `payload` looks complete, else why not (one phrase):
    its index is there and readable, and every file it refers to holds the bytes it
    names (the check for a checkpoint whose manifest lists no files)."""
    d = sharded_dir(payload)
    if not (d / _METADATA).is_file():
        return f"sharded state {d.name}/ is missing or incomplete"
    try:
        meta = read_dcp_metadata(d / _METADATA)
        need: dict[str, int] = {}
        for info in meta.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0),
                                           info.offset + info.length)
    except UntrustedFileError:
        raise
    except Exception as e:  # a damaged pickle can raise nearly anything
        return f"{d.name}/{_METADATA} unreadable ({type(e).__name__})"
    for name, n in sorted(need.items()):
        try:
            size = (d / name).stat().st_size
        except OSError:
            return f"{d.name}/{name} missing"
        if size < n:
            return f"{d.name}/{name} truncated: {size} bytes, {n} needed"
    return None


def shard_problem(payload: Path, rank: int, size: int) -> str | None:
    """This rank's share of the deep check: the digest of each shard file it is given."""
    try:
        entries = shard_entries(payload)
    except (OSError, ValueError) as e:
        return f"manifest unreadable ({type(e).__name__})"
    for rel, entry in share(entries, rank, size):
        problem = file_problem(payload.parent / rel, entry)
        if problem is not None:
            return f"{rel} {problem}"
    return None


def remove_sharded(payload: str | os.PathLike, files: Any = None) -> None:
    """Delete the DCP folder of checkpoint `payload`, if it has one (pruning old steps):
    only the files bigbatch wrote (recorded in `files`, the run's `RunFiles`; without a
    record, DCP's own), then the folder if it is empty. A folder that still holds
    another program's files stays, with a one-line note."""
    d = sharded_dir(payload)
    if not d.is_dir():
        return
    owns = (lambda p: files.owns_path(p)) if files is not None else None
    ours = [p for p in d.iterdir() if p.is_file() and is_dcp_file(p.name)
            and (owns is None or owns(p))]
    kept = remove_dcp_files(d, owns)
    if files is not None:
        files.discard(*ours)
        if not d.exists():
            files.forget_dir(d)
    if kept:
        log.warning("note: kept %s/ for %s, which bigbatch did not write", d.relative_to(
            d.parent.parent) if d.parent.parent != d.parent else d.name,
            kept[0] if len(kept) == 1 else f"{kept[0]} and {len(kept) - 1} more")


def check_sharded_fits(payload: str | os.PathLike, model: nn.Module, shapes: bool = True) -> None:
    """ConfigError unless the saved model tensors have `model`'s names (and whole shapes,
    unless `shapes` is false: a tensor-parallel run pads its vocabulary)."""
    meta = read_dcp_metadata(sharded_dir(payload) / _METADATA).state_dict_metadata
    saved = {k.removeprefix("model."): tuple(v.size) for k, v in meta.items()
             if k.startswith("model.") and hasattr(v, "size")}
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if saved.keys() != want.keys():
        diff = sorted(saved.keys() ^ want.keys())
        raise ConfigError(f"--resume: checkpoint {Path(payload).name} does not fit this model: "
                          f"{len(diff)} tensor names differ (e.g. {diff[0]!r})")
    for name, shape in want.items() if shapes else ():
        if saved[name] != shape:
            raise ConfigError(f"--resume: checkpoint {Path(payload).name} does not fit this "
                              f"model: {name} is {list(saved[name])}, the model has {list(shape)}")


def whole_model_state(model: nn.Module, mesh: Any = None,
                      pipeline: Any = None) -> dict[str, torch.Tensor]:
    """Collective: the whole model's state dict as plain CPU tensors (complete on rank 0),
    with tensor parallelism's vocabulary padding taken off: what the unsplit model loads.
    With a `pipeline`, each stage's part is gathered to rank 0 and merged by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from bigbatch.parallel.tensor_parallel import is_padded, unpadded_state_dict

    if is_padded(model):
        # torch warns that gathering FSDP2-over-TP shards takes two all-gathers: it is once.
        quiet = logging.getLogger("torch.distributed.tensor._redistribute")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            part = {k: v.cpu() for k, v in unpadded_state_dict(model).items()}
        finally:
            quiet.setLevel(level)
    else:
        # Every rank keeps its gathered copy when stages live on other ranks than rank 0.
        part = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=pipeline is None))
        part = {k: v.cpu() for k, v in part.items()}
    if pipeline is None:
        return part
    import torch.distributed as dist

    first = mesh.data_rank == 0 and mesh.tensor_rank == 0
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part if first else {}, parts, dst=0)
    if dist.get_rank() != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for stage_part in parts:
        merged.update(stage_part)
    return merged
