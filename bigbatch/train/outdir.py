"""The output directory of a run, and the record of what bigbatch wrote in it.

bigbatch deletes only files it wrote itself. Before it writes a file in `OUT` it
adds its path to `OUT/.bigbatch-files.json` (and the folders it created); only
recorded paths are ever deleted: by `--overwrite`, when old checkpoints are
pruned, and the temporary files of saves that a killed job left behind. A folder
is never removed because of its name, only when bigbatch created it and it is
empty. A sharded save's temporary folder (`checkpoints/.step-N.tmp/`) is recorded
before DCP writes in it; the files DCP names there are bigbatch's, and a leftover
one is removed on the next start (fresh, `--resume` or `--overwrite`). A directory
written by bigbatch 0.1.0 (no record) is recognised by its `run.json`, and its
files by their exact names.

Deletion is confined (`bigbatch.train.confined`): every entry of the record must be a
path that resolves, after symlinks, inside `OUT`; a record naming anything else
(`../x`, an absolute path, a file behind a symlink out of `OUT`) is refused as a whole
before anything is deleted, and each deletion checks again.

Every check here reads only: a mistake is reported before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World, broadcast
from bigbatch.train.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointDamagedError,
    latest_checkpoint,
    list_checkpoints,
    manifest_path,
    resume_checkpoint,
    write_text_atomic,
)
from bigbatch.train.confined import entry_problem, resolves_inside, rmdir_inside, unlink_inside
from bigbatch.train.lock import LOCK_FILE, hold
from bigbatch.train.progress import METRICS_FILE, TENSORBOARD_DIR
from bigbatch.train.sharded import is_dcp_file, remove_dcp_files
from bigbatch.train.verified import agree_on_checkpoint

log = logging.getLogger(__name__)

__all__ = ["RECORD_FILE", "RUN_FILE", "RunFiles", "check_fresh", "check_out_path", "prepare_out"]

RUN_FILE = "run.json"
RECORD_FILE = ".bigbatch-files.json"
OUTPUT_FILES = (METRICS_FILE, "summary.json", "final.pt", "strategy.toml", RUN_FILE)
OUTPUT_DIRS = (CHECKPOINT_DIR, TENSORBOARD_DIR)
_TEMP = re.compile(r"^\.(.+)\.\d+\.tmp$")  # atomic writes: .NAME.PID.tmp beside NAME
_LEGACY = re.compile(r"^(checkpoints/step-\d+\.(pt|json)|tensorboard/events\.out\.tfevents\..+)$")
# A sharded save's temporary folder (bigbatch's by its name, recorded or from an older run).
_TEMP_DIR = re.compile(rf"^{CHECKPOINT_DIR}/\.step-\d+\.tmp$")


class RunFiles:
    """The paths (relative to `out`, '/'-separated) of the files and folders bigbatch wrote."""

    def __init__(self, out: str | os.PathLike, files: set[str] | None = None,
                 dirs: set[str] | None = None, temp_dirs: set[str] | None = None):
        self.out = Path(out)
        self.files, self.dirs = set(files or ()), set(dirs or ())
        self.temp_dirs = set(temp_dirs or ())
        """Temporary folders of sharded saves: DCP's files in them are bigbatch's."""

    @classmethod
    def read(cls, out: str | os.PathLike) -> RunFiles | None:
        """The record in `out`; for a 0.1.0 run (no record) its files by name; else None."""
        out = Path(out)
        try:
            data = json.loads((out / RECORD_FILE).read_text())
            found = cls(out, set(data["files"]), set(data["dirs"]),
                        set(data.get("temp_dirs", ())))
        except FileNotFoundError:
            found = None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{out / RECORD_FILE} is unreadable ({type(e).__name__}); "
                              "it records the files bigbatch wrote there") from None
        if found is None:
            if not _is_legacy_run(out):
                return None
            files = {name for name in OUTPUT_FILES if (out / name).is_file()}
            files |= {rel for d in OUTPUT_DIRS for rel in _listing(out, d)
                      if _LEGACY.match(rel)}
            dirs = {d for d in OUTPUT_DIRS
                    if (out / d).is_dir() and set(_listing(out, d)) <= files}
            found = cls(out, files, dirs)
        found.check_confined()
        return found

    def check_confined(self) -> None:
        """ConfigError naming the first entry that is not a path inside `out` (after
        symlinks): the whole record is checked before anything is deleted."""
        for entry in sorted((*self.files, *self.dirs, *self.temp_dirs), key=str):
            why = entry_problem(self.out, entry)
            if why is not None:
                raise ConfigError(
                    f"{self.out / RECORD_FILE} names {entry!r}, {why}; bigbatch deletes only "
                    "what it wrote inside --out, and deleted nothing (remove that entry from "
                    "the record, or choose another --out)")

    def save(self) -> None:
        write_text_atomic(self.out / RECORD_FILE, json.dumps(
            {"format": 1, "files": sorted(self.files), "dirs": sorted(self.dirs),
             "temp_dirs": sorted(self.temp_dirs)}, indent=1) + "\n")

    def add(self, *paths: str | os.PathLike) -> None:
        """Record files before they are written (saved at once when any is new)."""
        new = {self._rel(p) for p in paths} - self.files
        if new:
            self.files |= new
            self.save()

    def discard(self, *paths: str | os.PathLike) -> None:
        """Forget files bigbatch has deleted."""
        gone = {self._rel(p) for p in paths} & self.files
        if gone:
            self.files -= gone
            self.save()

    def make_dir(self, rel: str) -> Path:
        """`out/rel`, created (and recorded as ours) if it does not exist."""
        path = self.out / rel
        if not path.is_dir():
            self.dirs.add(rel)
            self.save()
            path.mkdir(parents=True, exist_ok=True)
        return path

    def add_temp_dir(self, path: str | os.PathLike) -> None:
        """Record a sharded save's temporary folder before anything is written in it (and
        the checkpoints folder it is in, when bigbatch makes that)."""
        rel = self._rel(path)
        parent = rel.rpartition("/")[0]
        if parent and not (self.out / parent).is_dir():
            self.make_dir(parent)
        if rel not in self.temp_dirs:
            self.temp_dirs.add(rel)
            self.save()

    def discard_temp_dir(self, path: str | os.PathLike) -> None:
        """Forget a temporary folder that is gone (renamed or removed)."""
        rel = self._rel(path)
        if rel in self.temp_dirs and not (self.out / rel).exists():
            self.temp_dirs.discard(rel)
            self.save()

    def add_dir(self, path: str | os.PathLike, files: list[Path]) -> None:
        """Record a folder bigbatch is about to make (by a rename) and its files."""
        self.dirs.add(self._rel(path))
        self.files |= {self._rel(p) for p in files}
        self.save()

    def forget_dir(self, path: str | os.PathLike) -> None:
        """Forget a folder bigbatch removed."""
        rel = self._rel(path)
        if rel in self.dirs:
            self.dirs.discard(rel)
            self.save()

    def owns(self, rel: str) -> bool:
        """True for a recorded file, the record and lock themselves, a leftover temporary
        file of a recorded file, and the files DCP names in a sharded save's temporary
        folder; never a path that resolves outside `out`."""
        if not resolves_inside(self.out, self.out / rel):
            return False
        if rel in self.files or rel in (RECORD_FILE, LOCK_FILE):
            return True
        head, _, name = rel.rpartition("/")
        if (head in self.temp_dirs or _TEMP_DIR.match(head)) and is_dcp_file(name):
            return True
        m = _TEMP.match(name)
        return m is not None and self.owns(f"{head}/{m[1]}" if head else m[1])

    def owns_path(self, path: str | os.PathLike) -> bool:
        """`owns` for a path given as `out / ...`."""
        return self.owns(self._rel(path))

    def leftover_temps(self) -> list[Path]:
        """Temporary files of interrupted saves of recorded files."""
        found = []
        for d in {"", *self.dirs, *OUTPUT_DIRS}:
            for rel in _listing(self.out, d, recursive=False):
                name = rel.rpartition("/")[2]
                if _TEMP.match(name) and self.owns(rel):
                    found.append(self.out / rel)
        return found

    def leftover_temp_dirs(self) -> list[Path]:
        """Temporary folders of interrupted sharded saves (recorded, or named as ours)."""
        names = set(self.temp_dirs)
        names |= {f"{CHECKPOINT_DIR}/{p.name}" for p in _folders(self.out / CHECKPOINT_DIR)
                  if _TEMP_DIR.match(f"{CHECKPOINT_DIR}/{p.name}")}
        return [self.out / rel for rel in sorted(names) if (self.out / rel).is_dir()]

    def remove_temps(self) -> None:
        """Delete the temporary files and folders that interrupted saves left behind (a
        folder only once it is empty: another program's file in it stays, with a note)."""
        for p in self.leftover_temps():
            unlink_inside(self.out, p)
        for d in self.leftover_temp_dirs():
            kept = remove_dcp_files(d, self.owns_path)
            if kept:
                log.warning("note: kept %s/ for %s, which bigbatch did not write",
                            self._rel(d), kept[0])
        gone = {rel for rel in self.temp_dirs if not (self.out / rel).exists()}
        if gone:
            self.temp_dirs -= gone
            self.save()

    def begin(self, overwrite: bool = False) -> None:
        """Before a run writes: with `overwrite` delete the previous run's files; remove the
        temporary files of interrupted saves; save the record."""
        if overwrite:
            self.remove_all()
        self.out.mkdir(parents=True, exist_ok=True)
        self.remove_temps()
        self.save()

    def remove_all(self) -> None:
        """Delete every recorded file, then the recorded folders that are left empty."""
        self.remove_temps()
        self.check_confined()
        for rel in sorted(self.files):
            unlink_inside(self.out, self.out / rel)
        self.files.clear()
        for rel in sorted(self.dirs, key=lambda r: r.count("/"), reverse=True):
            rmdir_inside(self.out, self.out / rel)  # kept when it holds what we did not write
        self.dirs = {d for d in self.dirs if (self.out / d).is_dir()}
        self.save()

    def holds_run(self) -> bool:
        return any((self.out / rel).is_file() for rel in self.files)

    def _rel(self, path: str | os.PathLike) -> str:
        """`path` relative to `out`: given as `out / ...`, or already relative to it."""
        p = Path(path)
        with contextlib.suppress(ValueError):
            return p.relative_to(self.out).as_posix()
        if not p.is_absolute():
            return p.as_posix()
        return p.resolve().relative_to(self.out.resolve()).as_posix()


def _folders(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.is_dir()] if path.is_dir() else []


def _listing(out: Path, rel: str, recursive: bool = True) -> list[str]:
    """Paths under `out/rel`, relative to `out` ('/'-separated); [] when it is no folder."""
    base = out / rel if rel else out
    if not base.is_dir():
        return []
    found = []
    for p in (base.rglob("*") if recursive else base.iterdir()):
        if not p.is_dir():
            found.append(p.relative_to(out).as_posix())
    return found


def _is_legacy_run(out: Path) -> bool:
    try:
        saved = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return bool(list_checkpoints(out)) and all(
            manifest_path(p).is_file() for p in list_checkpoints(out))
    return isinstance(saved, dict) and {"task", "seed", "out"} <= set(saved)


def check_out_path(out: str | os.PathLike) -> None:
    """`--out` can be a directory bigbatch writes in: not a file, not under one, writable."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        why = "read-only file system" if read_only else "permission denied"
        raise ConfigError(f"--out {out}: {existing} is not writable ({why})")


def check_fresh(out: str | os.PathLike, overwrite: bool) -> RunFiles | None:
    """A fresh run may write into `out`: it holds no run (unless `overwrite`), and none of
    the paths a run writes is taken by something bigbatch did not write. Returns the record."""
    out = Path(out)
    files = RunFiles.read(out)
    if files is not None and files.holds_run() and not overwrite:
        raise ConfigError(f"--out {out} holds a run ({_describe(out)}); continue it with "
                          "--resume, or replace it with --overwrite (only the files bigbatch "
                          "wrote are deleted)")
    mine = files if files is not None else RunFiles(out)
    for name in OUTPUT_FILES:
        if (out / name).exists() and not mine.owns(name):
            raise ConfigError(f"--out {out}: {name} exists and bigbatch did not write it; "
                              "choose another --out")
    for d in OUTPUT_DIRS:
        if (out / d).exists() and not (out / d).is_dir():
            raise ConfigError(f"--out {out}: {d} exists and is not a directory; "
                              "choose another --out")
        foreign = [rel for rel in _listing(out, d) if not mine.owns(rel)]
        if foreign:
            raise ConfigError(f"--out {out}: {d}/ holds {foreign[0]} and more that bigbatch did "
                              "not write; choose another --out" if len(foreign) > 1 else
                              f"--out {out}: {d}/ holds {foreign[0]}, which bigbatch did not "
                              "write; choose another --out")
    return files


def _describe(out: Path) -> str:
    if (out / "summary.json").is_file():
        return "finished"
    ckpt = latest_checkpoint(out, warn=False)
    return f"latest checkpoint {ckpt.name}" if ckpt is not None else "no checkpoint"


def prepare_out(config: Any, world: World, held: contextlib.ExitStack
                ) -> tuple[Path | None, RunFiles | None]:
    """Check the output directory and take its lock (rank 0; `held` keeps it): returns the
    checkpoint to resume from (None for a fresh run; every rank: the newest whose every
    file every rank verified, `bigbatch.train.verified`) and, on rank 0, the record of the
    run's files. A ConfigError or `CheckpointDamagedError` is raised on every rank.

    Nothing is written here but the lock: `RunFiles.begin` writes, once the run's own
    checks have passed.
    """
    out = Path(config.out)
    ckpt, files, error = None, None, None
    if world.rank == 0:
        try:
            check_out_path(out)
            for locked in (False, True):  # read-only checks, then again under the lock
                if locked:
                    held.enter_context(hold(out))
                if config.resume:
                    ckpt = resume_checkpoint(out, trust=config.trust_checkpoint)
                    files = RunFiles.read(out) or RunFiles(out)
                else:
                    files = check_fresh(out, config.overwrite) or RunFiles(out)
        except (ConfigError, CheckpointDamagedError) as e:
            error = (isinstance(e, ConfigError), str(e))
    error, ckpt = broadcast((error, str(ckpt) if ckpt else None), world)
    if error is not None:
        usage, message = error
        if usage:
            raise ConfigError(message)
        damaged = CheckpointDamagedError(message)
        damaged.everywhere = True
        raise damaged
    if ckpt is None:
        return None, files
    return agree_on_checkpoint(out, Path(ckpt), world), files
