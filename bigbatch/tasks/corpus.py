"""charlm's corpora: text that ships with every Python, split into train and held-out ids.

- `topics` (the default): `pydoc_data.topics.topics`, the help texts (about 465k
  characters in CPython 3.11), joined in sorted-key order; the vocabulary is every
  character it holds; the last `test_fraction` of the characters is held out. Small and
  built in a fraction of a second, so it is not cached: the fast default for tests.
- `stdlib`: the standard library's own `.py` sources under `sysconfig`'s `stdlib` path
  (tens of MB), so a large batch has more than a few epochs of fresh text to chew on.
  Not read: `site-packages`/`dist-packages`, test suites (any directory named `test`,
  `tests` or `idle_test`: `test/`, `unittest/test`, `idlelib/idle_test`,
  `lib2to3/tests`, ...), `__pycache__`, and files that are not valid UTF-8. Files are
  taken in sorted relative-path order, so the text is deterministic for one Python.

The `stdlib` vocabulary is fixed: tab, newline, the 95 printable ASCII characters and one
unknown id (`UNKNOWN`) for everything else (non-ASCII, `\\r`, form feeds), 98 ids in all,
so the model's embedding stays small whatever the files hold. Held out are whole files,
never a part of one: file `i` of the sorted list is a test file when
`floor((i + 1) * f) > floor(i * f)` for `f = test_fraction`, an evenly spread fraction
of the files (`f = 0.1`: files 9, 19, 29, ...), so no test text is trained on and the
test set samples every corner of the library rather than its last packages.

`max_chars` (the task's `corpus_chars`) caps the corpus at N characters: the first
`N - round(N * f)` characters of the training files and the first `round(N * f)` of the
held-out files (both in file order), so a budget keeps the same split.

A built `stdlib` corpus is cached as a `.pt` file (uint8 ids and the vocabulary) in the
same directory as MNIST-1D (`bigbatch.tasks.cache_dir`). Its key holds the Python
implementation and version, a sha256 over the sorted file list with each file's size,
the vocabulary, `test_fraction` and `max_chars`: a Python upgrade or an added, removed
or resized file builds it again (a file edited in place to the same size does not).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bigbatch.errors import ConfigError
from bigbatch.tasks._base import cache_file, check_cache_dir, load_cached, save_cached

log = logging.getLogger("bigbatch.tasks")

CORPORA = ("topics", "stdlib")
"""The corpus names `--task-opt corpus=...` takes; the first is the default."""

UNKNOWN = "\ufffd"
"""The character standing for every character outside the `stdlib` vocabulary."""

STDLIB_VOCAB = ("\t", "\n", *(chr(c) for c in range(32, 127)), UNKNOWN)
"""The `stdlib` corpus's characters, in id order (98)."""

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                       "__pycache__"})
"""Directory names whose whole subtree the `stdlib` corpus leaves out."""

FORMAT = 1
"""Version of the cached `stdlib` layout; part of the key, bumped when it changes."""


@dataclass
class Corpus:
    """A built corpus: its vocabulary, train and held-out ids (int64), where it came from."""

    name: str
    chars: list[str]
    train: torch.Tensor
    test: torch.Tensor
    identity: dict = field(default_factory=dict)
    """JSON-able facts that identify the text: Python, files, characters, hashes."""
    cache_path: Path | None = None
    generated: bool = False
    """Built now (not read from the cache)."""
    seconds: float = 0.0
    """Time the build took (when it was built, now or for the cache)."""

    def line(self) -> str:
        """One line for a run's header: which text the model reads, and from where."""
        i = self.identity
        chars = (f"{_count(i['characters'])} characters (held out {_count(i['test_characters'])}"
                 f"), vocab {len(self.chars)}")
        if self.name == "topics":
            return (f"data: charlm corpus topics, {i['python']} pydoc_data.topics: {chars}, "
                    f"text sha256 {i['text_sha256'][:12]}")
        files = (f"{i['files_used']} of {i['files']} files ({i['held_out_files']} held out"
                 + (f", {i['skipped']} not UTF-8" if i["skipped"] else "") + ")")
        where = (f"built in {self.seconds:.1f} s" if self.generated
                 else f"cached, built in {self.seconds:.1f} s")
        return (f"data: charlm corpus stdlib, {i['python']} {i['root']}: {files}, {chars}, "
                f"{i['unknown']} unknown; files sha256 {i['files_sha256'][:12]}; "
                f"{self.cache_path} ({where})")


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n:,}"


def python_identity() -> str:
    """This interpreter, e.g. `CPython 3.11.7`: the standard library's text depends on it."""
    impl = {"cpython": "CPython", "pypy": "PyPy"}.get(sys.implementation.name,
                                                      sys.implementation.name)
    return f"{impl} {'.'.join(map(str, sys.version_info[:3]))}"


def topics_text() -> str:
    """The `topics` text, deterministic for a given Python version."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


def stdlib_root() -> Path:
    """The standard library's directory (in a virtual environment: the base install's)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[tuple[str, int]]:
    """`(relative posix path, size in bytes)` of every candidate `.py` file under `root`,
    sorted by path (see the module docstring for what is left out)."""
    found = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in names:
            if name.endswith(".py"):
                path = Path(directory, name)
                found.append((path.relative_to(root).as_posix(), path.stat().st_size))
    return sorted(found)


def files_hash(files: list[tuple[str, int]]) -> str:
    """sha256 over the sorted file list with sizes: cheap (stat only), changes with it."""
    h = hashlib.sha256()
    for rel, size in files:
        h.update(f"{rel}\t{size}\n".encode())
    return h.hexdigest()


def held_out(index: int, test_fraction: float) -> bool:
    """Whether file `index` (in sorted order) is a test file: an evenly spread fraction."""
    eps = 1e-9  # 0.1 * 30 is 3.0000000000000004 in floats; never let rounding move a file
    return math.floor((index + 1) * test_fraction + eps) > math.floor(index * test_fraction + eps)


_LOOKUP = np.full(128, len(STDLIB_VOCAB) - 1, dtype=np.uint8)
for _i, _c in enumerate(STDLIB_VOCAB[:-1]):
    _LOOKUP[ord(_c)] = _i


def encode_stdlib(text: str) -> np.ndarray:
    """`text` as `STDLIB_VOCAB` ids (uint8); characters outside it become the unknown id."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.full(points.shape, len(STDLIB_VOCAB) - 1, dtype=np.uint8)
    ascii_ = points < 128
    ids[ascii_] = _LOOKUP[points[ascii_]]
    return ids


def load_corpus(name: str = "topics", *, test_fraction: float = 0.1,
                max_chars: int | None = None, cache: str | os.PathLike | None = None,
                root: str | os.PathLike | None = None) -> Corpus:
    """Corpus `name` (one of `CORPORA`) split `1 - test_fraction : test_fraction`, capped
    at `max_chars` characters; `stdlib` is read from the cache when it holds it.
    `root`: the directory read as the standard library (default `stdlib_root()`)."""
    if name not in CORPORA:
        raise ConfigError(f"corpus={name!r} is not a charlm corpus; allowed: {', '.join(CORPORA)}")
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction={test_fraction} is out of range; allowed: (0, 1)")
    if max_chars is not None and max_chars < 2:
        raise ConfigError(f"corpus_chars={max_chars} is too small; allowed: >= 2")
    if name == "topics":
        return _topics(test_fraction, max_chars)
    return _stdlib(Path(root) if root is not None else stdlib_root(), test_fraction,
                   max_chars, cache)


def _topics(test_fraction: float, max_chars: int | None) -> Corpus:
    t0 = time.perf_counter()
    text = topics_text()[:max_chars]
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(len(ids) * (1.0 - test_fraction))
    identity = {"corpus": "topics", "python": python_identity(), "characters": len(ids),
                "test_characters": len(ids) - split,
                "text_sha256": hashlib.sha256(text.encode()).hexdigest()}
    return Corpus("topics", chars, ids[:split], ids[split:], identity,
                  seconds=time.perf_counter() - t0)


def stdlib_key(files: list[tuple[str, int]], test_fraction: float,
               max_chars: int | None) -> dict:
    """What identifies a built `stdlib` corpus (the cache key)."""
    return {"corpus": "stdlib", "format": FORMAT,
            "python": [sys.implementation.name, *sys.version_info[:3]],
            "files_sha256": files_hash(files), "files": len(files),
            "vocab": "".join(STDLIB_VOCAB), "test_fraction": float(test_fraction),
            "max_chars": None if max_chars is None else int(max_chars)}


def _stdlib(root: Path, test_fraction: float, max_chars: int | None,
            cache: str | os.PathLike | None) -> Corpus:
    if not root.is_dir():
        raise ConfigError(f"corpus='stdlib': the standard library directory {root} "
                          f"does not exist")
    files = stdlib_files(root)
    if not files:
        raise ConfigError(f"corpus='stdlib': no .py files under {root}")
    key = stdlib_key(files, test_fraction, max_chars)
    path = cache_file("charlm-stdlib", key, cache)
    blob = load_cached(path, key)
    generated = blob is None
    if blob is None:
        check_cache_dir(path.parent)
        log.info("building the charlm stdlib corpus from %s once; cache: %s", root, path)
        blob = build_stdlib(root, files, test_fraction, max_chars)
        blob["key"] = key
        save_cached(blob, path)
    return Corpus("stdlib", list(blob["chars"]), blob["train"].long(), blob["test"].long(),
                  dict(blob["identity"]), path, generated, float(blob["seconds"]))


def build_stdlib(root: Path, files: list[tuple[str, int]], test_fraction: float,
                 max_chars: int | None) -> dict:
    """Read and encode the files: `{"chars", "train", "test" (uint8 ids), "identity",
    "seconds"}`. With `max_chars`, reading stops once both splits are full."""
    t0 = time.perf_counter()
    budget = {True: None, False: None}  # held out -> characters still wanted
    if max_chars is not None:
        budget[True] = round(max_chars * test_fraction)
        budget[False] = max_chars - budget[True]
    parts: dict[bool, list[np.ndarray]] = {True: [], False: []}
    used = {True: 0, False: 0}
    skipped = 0
    for index, (rel, _) in enumerate(files):
        test = held_out(index, test_fraction)
        left = budget[test]
        if left == 0:
            if budget[not test] == 0:
                break
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if not text.endswith("\n"):
            text += "\n"  # every file ends its last line: files never run together
        if left is not None:
            text = text[:left]
            budget[test] = left - len(text)
        parts[test].append(encode_stdlib(text))
        used[test] += 1
    train, test = (torch.from_numpy(np.concatenate(parts[t] or [np.zeros(0, np.uint8)]))
                   for t in (False, True))
    both = hashlib.sha256(train.numpy().tobytes())
    both.update(test.numpy().tobytes())
    identity = {"corpus": "stdlib", "python": python_identity(), "root": str(root),
                "files": len(files), "files_used": used[False] + used[True],
                "held_out_files": used[True], "skipped": skipped,
                "characters": train.numel() + test.numel(), "test_characters": test.numel(),
                "unknown": int((train == len(STDLIB_VOCAB) - 1).sum()
                               + (test == len(STDLIB_VOCAB) - 1).sum()),
                "files_sha256": files_hash(files), "text_sha256": both.hexdigest()}
    return {"chars": list(STDLIB_VOCAB), "train": train, "test": test, "identity": identity,
            "seconds": time.perf_counter() - t0}
