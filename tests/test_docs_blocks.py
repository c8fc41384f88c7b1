"""Every fenced code block in README.md and the docs runs (one test per block, named
`file:line`), and every number in a `numbers-from` section is in the file it cites.

The conventions (docs/development.md, "Code blocks in the docs"):

- `python` blocks are executed as written, each in a fresh namespace, in a temporary
  directory; `toml` blocks are read by `Strategy.from_toml`; `bash` blocks run each
  `bigbatch ...` line through the real CLI in one temporary directory per block,
  shortened (`shorten` below); `text` blocks are output, not code.
- An HTML comment on the line above a block marks it: `<!-- not-run: reason -->` (a
  skip with that reason), `<!-- slow: reason -->` (the slow tier), or
  `<!-- tested-by: tests/test_x.py -->` (that test runs the page's blocks itself).
- `<!-- numbers-from: PATH -->` ... `<!-- /numbers-from -->`: each number between the
  markers appears in PATH, a file a study or a benchmark wrote.

The reports `bigbatch study` writes (docs/study/report.md, docs/kfac-study/report.md) are
left out: their one block is the command that wrote them, as the study printed it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._cli import cli_env

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "docs" / "kfac-study" / "README.md"]
LANGUAGES = ("python", "toml", "bash", "text")
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(not-run|slow|tested-by)\s*:\s*(.+?)\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None = None
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(above)
        found.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           *(marker.groups() if marker else ())))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def _param(block: Block):
    marks = [pytest.mark.slow] if block.marker == "slow" else []
    return pytest.param(block, id=block.id, marks=marks)


# -- bash: the CLI, shortened ---------------------------------------------------------

def commands(code: str) -> list[list[str]]:
    """The block's commands: backslash continuations joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", code)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def _drop(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _mnist1d(argv: list[str], samples: int) -> list[str]:
    if (_value(argv, "--task") or "mnist1d") == "mnist1d" and "num_samples=" not in " ".join(argv):
        return [*argv, "--task-opt", f"num_samples={samples}"]
    return argv


def shorten(argv: list[str], resumes: dict[str, int], slow: bool) -> list[str]:
    """`bigbatch ...` as the docs write it, at a size a test can afford: a few steps (a
    resume a few more than the run it continues), 10,000 MNIST-1D samples (20,000 and
    more steps in the slow tier, where batches grow with the workers), one worker where
    the block names none, no progress bar or TensorBoard; a study of one epoch."""
    command, args = argv[1], argv[2:]
    if command == "train":
        out = _value(args, "--out") or "runs/train"
        steps = (8 if slow else 3) + 2 * resumes.get(out, 0)
        resumes[out] = resumes.get(out, 0) + 1
        args = _drop(_drop(args, "--steps"), "--epochs") + ["--steps", str(steps)]
        if _value(args, "--nproc") is None:
            args += ["--nproc", "1"]
        args = _mnist1d(args, 20_000 if slow else 10_000)
        args += [f for f in ("--no-progress", "--no-tensorboard") if f not in args]
    elif command == "study":
        args = _drop(args, "--epochs") + ["--epochs", "1", "--threads", "1", "--no-progress"]
        args = _mnist1d(args, 20_000)
    elif command == "lr-find":
        args = _mnist1d(_drop(args, "--steps") + ["--steps", "5"], 10_000)
    elif command == "gns":
        args = _mnist1d(args, 10_000)
    elif command == "monitor" and "--png" not in args and "--once" not in args:
        args = [*args, "--once"]
    return ["bigbatch", command, *args]


def run_shell(block: Block, tmp_path: Path, cache: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the docs' relative paths
    resumes: dict[str, int] = {}
    for argv in commands(block.code):
        assert argv[0] == "bigbatch", (
            f"{block.id}: `{shlex.join(argv)}` is not a bigbatch command; mark the block "
            "<!-- not-run: reason --> if it cannot run in a test")
        short = shorten(argv, resumes, block.marker == "slow")
        env = cli_env(cache)
        p = subprocess.run([sys.executable, "-m", "bigbatch", *short[1:]], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (f"{block.id}: `{shlex.join(short)}` exited "
                                   f"{p.returncode}:\n{p.stderr[-3000:]}")


# -- the tests ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One MNIST-1D cache for the module (and the session's other CLI tests)."""
    return tmp_path_factory.getbasetemp() / "xdg-cache"


@pytest.mark.parametrize("block", [_param(b) for b in ALL])
def test_block_runs(block, tmp_path, monkeypatch, cache, one_thread):
    assert block.language in LANGUAGES, (
        f"{block.id}: a block needs a language, one of {', '.join(LANGUAGES)}")
    if block.marker == "not-run":
        pytest.skip(f"not-run: {block.reason}")
    if block.marker == "tested-by":
        test = ROOT / block.reason
        assert test.is_file(), f"{block.id}: {block.reason} does not exist"
        assert block.page.name in test.read_text(), f"{block.reason} never names {block.page.name}"
        return
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if block.language == "python":
        exec(compile(block.code, block.id, "exec"), {"__name__": "__docs__"})
    elif block.language == "toml":
        from bigbatch.config.strategy import Strategy

        Strategy.from_toml(block.code)
    elif block.language == "bash":
        run_shell(block, tmp_path, cache)


def test_blocks_were_found():
    counts = {lang: sum(b.language == lang for b in ALL) for lang in LANGUAGES}
    assert counts["python"] >= 10 and counts["toml"] >= 8 and counts["bash"] >= 10, counts
    marked = [b.id for b in ALL if b.marker is None and b.language == "bash"]
    assert any(i.startswith("README.md:") for i in marked), "the README's short tries run"


def test_shortened_commands():
    resumes: dict[str, int] = {}
    first = shorten(["bigbatch", "train", "--steps", "20", "--out", "runs/x"], resumes, False)
    again = shorten(["bigbatch", "train", "--resume", "--out", "runs/x"], resumes, False)
    assert first[first.index("--steps") + 1] == "3" and again[again.index("--steps") + 1] == "5"
    assert "num_samples=10000" in first and first[first.index("--nproc") + 1] == "1"
    charlm = shorten(["bigbatch", "train", "--task", "charlm", "--nproc", "2"], {}, True)
    assert not any("num_samples" in a for a in charlm) and charlm.count("--nproc") == 1
    assert commands("bigbatch a \\\n  --b 1   # c\n# d\n\nbigbatch e\n") == [
        ["bigbatch", "a", "--b", "1"], ["bigbatch", "e"]]


# -- numbers come from files ----------------------------------------------------------

SECTION = re.compile(r"<!--\s*numbers-from:\s*(\S+)\s*-->\n(.*?)<!--\s*/numbers-from\s*-->", re.S)
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def _numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in NUMBER.findall(text)}


SECTIONS = [(page, source, body) for page in PAGES
            for source, body in SECTION.findall(page.read_text())]


@pytest.mark.parametrize("page, source, body", SECTIONS,
                         ids=[f"{p.relative_to(ROOT)}<-{s}" for p, s, _ in SECTIONS])
def test_quoted_numbers_are_in_their_file(page, source, body):
    path = ROOT / source
    assert path.is_file(), f"{page.name} cites {source}, which does not exist"
    missing = _numbers(body) - _numbers(path.read_text())
    assert not missing, f"{page.name}: numbers not in {source}: {sorted(missing)}"


def test_sections_are_closed():
    for page in PAGES:
        text = page.read_text()
        opened = re.findall(r"^<!--\s*numbers-from:", text, re.M)
        assert len(opened) == len(SECTION.findall(text)), page.name


def test_no_stale_numbers_in_the_readme():
    """The demo's accuracy and time, and lr-find's example, are not quoted outside a
    numbers-from section (they change with every run; results.md cites the files)."""
    text = SECTION.sub("", (ROOT / "README.md").read_text())
    assert not re.search(r"\d+\.\d+%", text), "a percentage outside a numbers-from section"
    assert not re.search(r"\b\d+ s\b", text), "a run time in the README"
