"""Deletion stays inside `--out`: what bigbatch may delete is a path that resolves, after
every symlink, inside the run's directory. A symlink there that points elsewhere is at
most removed itself; what it points to never is.

The checks read only; `unlink_inside` and `rmdir_inside` check again at the moment they
delete (a folder swapped for a symlink meanwhile is left alone).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path, PurePosixPath

__all__ = ["entry_problem", "resolves_inside", "rmdir_inside", "unlink_inside"]


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.fspath(path))


def _under(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def resolves_inside(out: str | os.PathLike, path: str | os.PathLike) -> bool:
    """True when `path` (and whatever it links to) lies inside `out`."""
    try:
        return _under(_real(path), _real(out))
    except (OSError, ValueError):  # a NUL byte, a loop of links
        return False


def _folder_inside(out: str | os.PathLike, path: Path) -> bool:
    """True when the folder holding `path` resolves inside `out` (`path` itself may be a
    link: removing it removes the link only)."""
    try:
        return _under(_real(path.parent), _real(out))
    except (OSError, ValueError):
        return False


def entry_problem(out: str | os.PathLike, rel: object) -> str | None:
    """Why a record's entry `rel` (a path relative to `out`, '/'-separated) is not a path
    bigbatch may delete, in a few words; None when it is one."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return "which is not a path inside --out"
    pure = PurePosixPath(rel)
    if pure.is_absolute():
        return "an absolute path"
    if ".." in pure.parts:
        return "which leads out of --out"
    if not pure.parts:
        return "which is --out itself"
    path = Path(out, *pure.parts)
    if not resolves_inside(out, path):
        try:
            target = _real(path)
        except (OSError, ValueError):
            return "a loop of symlinks"
        how = "a symlink" if path.is_symlink() else "under a symlink"
        return f"{how} that resolves to {target}, outside --out"
    return None


def unlink_inside(out: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Delete the file `path` when its folder resolves inside `out` (a symlink: the link
    itself, never its target). Returns True when something was deleted."""
    path = Path(path)
    if not _folder_inside(out, path) or not (path.is_symlink() or path.is_file()):
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def rmdir_inside(out: str | os.PathLike, path: str | os.PathLike) -> None:
    """Remove the folder `path` when it is empty, a real folder (not a link) and inside
    `out`."""
    path = Path(path)
    if path.is_symlink() or not resolves_inside(out, path):
        return
    with contextlib.suppress(OSError):  # not empty: it holds what bigbatch did not write
        path.rmdir()
