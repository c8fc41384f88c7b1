"""A checkpoint's manifest: the size and sha256 of every file the checkpoint holds.

`checkpoints/step-N.json` is written last, once every file of step N is on disk: it
is the checkpoint's commit point. It names the payload `step-N.pt` (its size and
digest at the top level, as format 1 had them) and, for a sharded checkpoint, every
file DCP wrote into `step-N/` (`files`, keyed by the path relative to `checkpoints/`).

Checking a checkpoint has two depths. `payload_problem` and `listed_problem` read the
payload and the small files whole (DCP's `.metadata`, which a resume reads before
loading) and only the sizes of the shards: cheap enough for the launcher. The
shards' digests are checked by the workers together (`file_problem` on each rank's
share of `shard_entries`), before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_FORMAT", "SMALL_FILE", "digest", "file_problem", "listed_problem",
           "manifest_path", "read_manifest", "shard_entries", "share", "write_manifest"]

MANIFEST_FORMAT = 2
"""1: the payload's size and sha256; 2 adds `files`, every other file of the checkpoint."""
SMALL_FILE = ".metadata"
"""The one shard-folder file the cheap check hashes: DCP's index, read before a load."""


def manifest_path(payload: str | os.PathLike) -> Path:
    """The manifest beside checkpoint payload `payload`."""
    return Path(payload).with_suffix(".json")


def digest(path: str | os.PathLike) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex digest} of the file at `path`."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


def write_manifest(payload: Path, step: int, files: dict[str, dict[str, Any]] | None,
                   write_text: Any) -> None:
    """The manifest of `payload` (hashed here) and of `files` (hashed by whoever wrote
    them), written with `write_text(path, text)` (atomic)."""
    top = digest(payload)
    write_text(manifest_path(payload), json.dumps(
        {"format": MANIFEST_FORMAT, "step": step, "payload": payload.name, **top,
         "files": dict(sorted((files or {}).items()))}))


def read_manifest(payload: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of `payload`, or None when there is none (raises on an unreadable one)."""
    path = manifest_path(payload)
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("files", {}), dict):
        raise ValueError(f"{path.name} is not a manifest")
    return meta


def file_problem(path: Path, entry: dict[str, Any], whole: bool = True) -> str | None:
    """None when the file at `path` matches its manifest `entry`, else why not; `whole`
    false compares only the size."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or type(e).__name__})"
    if size != entry["bytes"]:
        return f"truncated: {size} bytes, manifest says {entry['bytes']}" if size < entry[
            "bytes"] else f"{size} bytes, manifest says {entry['bytes']}"
    if not whole:
        return None
    try:
        if digest(path)["sha256"] != entry["sha256"]:
            return "checksum mismatch"
    except OSError as e:
        return f"unreadable ({e.strerror or type(e).__name__})"
    return None


def payload_problem(payload: Path, meta: dict[str, Any]) -> str | None:
    """None when the payload matches the manifest's top-level size and digest."""
    return file_problem(payload, meta)


def listed_problem(payload: Path, meta: dict[str, Any]) -> str | None:
    """The cheap check of the other files: present, of their sizes, `.metadata` hashed."""
    base = payload.parent
    for rel, entry in sorted(meta.get("files", {}).items()):
        problem = file_problem(base / rel, entry, whole=Path(rel).name == SMALL_FILE)
        if problem is not None:
            return f"{rel} {problem}"
    return None


def shard_entries(payload: Path) -> list[tuple[str, dict[str, Any]]]:
    """The manifest's entries that only the deep check hashes, in a fixed order."""
    meta = read_manifest(payload) or {}
    return [(rel, e) for rel, e in sorted(meta.get("files", {}).items())
            if Path(rel).name != SMALL_FILE]


def share(items: list[Any], rank: int, size: int) -> list[Any]:
    """This rank's part of `items`, when `size` ranks split them (round robin)."""
    return items[rank::size]
