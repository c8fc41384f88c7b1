"""Reading back what bigbatch wrote without running code: tensors and plain data only.

A pickle can name any importable callable and have it called while it loads, so a file
anyone could have written (a checkpoint, a `save_state` folder, DCP's index) is never
read with a full unpickler:

- `load_plain` reads a `torch.save` file with torch's weights-only unpickler: tensors,
  dicts, lists, tuples, strings, numbers, None, torch sizes, dtypes and devices. The
  numpy arrays (uint32 and the like) of files written before RNG states were stored
  as tensors are accepted too, as data: numpy's array rebuild is allowed for that one
  read and no other function is.
- `read_dcp_metadata` / `SafeReader` read DCP's ``.metadata`` with an unpickler that
  knows only DCP's own metadata classes and the few torch and standard types they hold;
  `SafePlanner` reads the non-tensor entries of DCP's shards weights-only as well.
- `check_plain` refuses, before anything is written, state that the readers above could
  not read back (a numpy scalar in a policy's state, an object in ``extra``).

Everything refused raises `UntrustedFileError` (a `ConfigError`: one line, exit 2)
naming the file and the first object it would not build.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import pathlib
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bigbatch.errors import ConfigError, UntrustedFileError

__all__ = ["SafePlanner", "SafeReader", "check_plain", "dcp_load", "load_plain",
           "read_dcp_metadata", "untrusted_cause"]

def _numpy_array_globals() -> list[Any]:
    """What unpickling a plain numpy array names (old RNG states), under both of numpy's
    module names for `_reconstruct` (numpy 1 pickles `numpy.core`, numpy 2 `numpy._core`)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    found: list[Any] = [np.ndarray, np.dtype, rebuild,
                        (rebuild, "numpy.core.multiarray._reconstruct"),
                        (rebuild, "numpy._core.multiarray._reconstruct")]
    dtypes = getattr(np, "dtypes", None)
    for name in ("UInt32DType", "Int64DType", "Float64DType", "UInt64DType", "Int32DType"):
        if dtypes is not None and hasattr(dtypes, name):
            found.append(getattr(dtypes, name))
    return found


def _refused_global(e: BaseException) -> str | None:
    """The global torch's weights-only unpickler would not build, from its message; None
    when it failed for another reason (not a pickle at all, say)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    return found.group(1) if found else None


def _why(e: BaseException) -> str:
    """torch's long weights-only message, down to its one telling line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else "")
    return line.split("WeightsUnpickler error:")[-1].strip()[:160] or type(e).__name__


def load_plain(source: str | os.PathLike | bytes, what: str, map_location: Any = "cpu") -> Any:
    """`torch.load` of `source` (a path or the file's bytes) weights-only; `what` names it
    in errors. Raises `UntrustedFileError` for a file that names any other object, a
    one-line `pickle.UnpicklingError` for one that is no pickle torch reads, and lets
    torch's other errors (not a zip, truncated) through for the caller to word."""
    data = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(data, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        name = _refused_global(e)
        if name is None:
            raise pickle.UnpicklingError(_why(e)) from None
        raise UntrustedFileError(
            f"{what} holds a pickled {name}, not tensors and plain data; refused unread "
            "(loading it could run code)") from None


# ----------------------------------------------------------------- DCP's index

def _dcp_metadata_types() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "ChunkStorageMetadata", "TensorStorageMetadata",
                 "BytesStorageMetadata", "TensorProperties", "StorageMeta", "MetadataIndex",
                 "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[(metadata.__name__, name)] = getattr(metadata, name)
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch", "device")] = torch.device
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = OrderedDict
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        for module in ("pathlib", "pathlib._local"):  # python 3.13 names the latter
            allowed[(module, name)] = getattr(pathlib, name)
    for name in ("set", "slice", "complex"):
        allowed[("builtins", name)] = getattr(builtins, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and torch's dtypes, sizes and layouts; nothing else."""

    def __init__(self, file: Any, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None),
                                                                torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return found


def read_dcp_metadata(path: str | os.PathLike, what: str | None = None) -> Any:
    """DCP's index at `path` (a ``.metadata`` file), built only from DCP's own types;
    `what` names it in errors (default: its folder and name). Raises `UntrustedFileError`
    for anything else, OSError when it cannot be read."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    what = what or f"{path.parent.name}/{path.name}"
    with open(path, "rb") as f:
        try:
            meta = _MetadataUnpickler(f, _dcp_metadata_types()).load()
        except pickle.UnpicklingError as e:
            raise UntrustedFileError(
                f"{what} names {str(e).splitlines()[0][:120]}, not DCP's index types; "
                "refused unread (loading it could run code)") from None
        except Exception as e:  # truncated or garbled: a damaged file, not an attack
            raise OSError(f"{what} unreadable ({type(e).__name__})") from None
    if not isinstance(meta, Metadata):
        raise UntrustedFileError(f"{what} holds a {type(meta).__name__}, not DCP's index; "
                                 "refused")
    return meta


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        """DCP's file-system reader, its index read by `read_dcp_metadata`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            meta = read_dcp_metadata(self._get_metadata_path(rank))
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return _SafeReader


def _planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _SafePlanner(DefaultLoadPlanner):
        """DCP's default load planner, its non-tensor entries read weights-only."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load_plain(value.getvalue(), f"the entry {fqn!r} of a DCP shard")
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return _SafePlanner


def SafeReader(path: str | os.PathLike) -> Any:  # noqa: N802 - a class, built lazily
    """A `FileSystemReader` of `path` whose index is read by `read_dcp_metadata`."""
    return _reader_class()(str(path))


def SafePlanner() -> Any:  # noqa: N802 - a class, built lazily
    """A `DefaultLoadPlanner` whose non-tensor entries are read weights-only."""
    return _planner_class()()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_load(state: dict[str, Any], folder: str | os.PathLike) -> None:
    """`dcp.load` of `folder` into `state` through `SafeReader` and `SafePlanner`
    (collective when a process group is up). A refusal inside DCP comes out as the
    `UntrustedFileError` it was, on every rank; DCP's other failures as DCP raised them."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeReader(folder), planner=SafePlanner(),
                     no_dist=not dist.is_initialized())
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        refusal = untrusted_cause(e)
        if refusal is None:
            raise
        raise refusal from None


def untrusted_cause(e: BaseException) -> UntrustedFileError | None:
    """The `UntrustedFileError` behind `e`, a DCP `CheckpointException` that carries each
    rank's failure (the lowest rank's), or None when a refusal is not why it failed."""
    if isinstance(e, UntrustedFileError):
        return e
    failures = getattr(e, "failures", None)
    for rank in sorted(failures) if isinstance(failures, dict) else ():
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, UntrustedFileError):
            return UntrustedFileError(str(inner))
    return None


# ----------------------------------------------------------------- before writing

# Exact types: a numpy scalar is an instance of float, but pickles as numpy's.
_PLAIN_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.Size, torch.dtype,
                torch.device, torch.Tensor, torch.nn.Parameter)


def check_plain(obj: Any, where: str) -> None:
    """ConfigError unless `obj` is what `load_plain` reads back without numpy: tensors,
    torch sizes, dtypes and devices, strings, bytes, numbers, None, and dicts, lists,
    tuples and sets of them. `where` names `obj` in the message (e.g. ``extra``)."""
    stack: list[tuple[Any, str]] = [(obj, where)]
    while stack:
        value, at = stack.pop()
        kind = type(value)
        if kind in (dict, OrderedDict):
            for k, v in value.items():
                stack.append((k, f"a key of {at}"))
                stack.append((v, f"{at}[{k!r}]"))
        elif kind in (list, tuple, set):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))
        elif kind not in _PLAIN_TYPES:
            name = f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")
            raise ConfigError(f"{at} is a {name}: only tensors and plain data (dict, list, "
                              "tuple, str, int, float, bool, None) are saved, so that "
                              "loading never runs code")
