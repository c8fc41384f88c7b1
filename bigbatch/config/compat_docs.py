"""`docs/compatibility.md`, rendered from the compatibility table (`bigbatch.config.compat`):
a matrix of the sections that conflict, then every row with its reason and fix.

    python -m bigbatch.config.compat_docs > docs/compatibility.md

A test compares the committed page with this output, so the page cannot go stale.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

from bigbatch.config.compat import CONFLICTS
from bigbatch.config.conflict import Conflict
from bigbatch.config.sections import SECTIONS

__all__ = ["render", "sections_of"]

_NAMED = re.compile(r"\[(\w+)\]|\b(\w+)\.\w+")

HEADER = """\
# Compatibility: what cannot go together

<!-- Generated from bigbatch/config/compat.py by `python -m bigbatch.config.compat_docs`;
edit the table there, not this page (tests/test_compat_table.py checks it). -->

Each combination below is refused with one line (a `ConfigError`; exit status 2 from the
CLI) before training starts: by `Strategy` as soon as the settings are read, by
`prepare()` where it depends on the model or the worker, or by `bigbatch train`'s
preflight before any worker starts. Where several apply, the first row is reported.
"""


def sections_of(label: str) -> list[str]:
    """The strategy sections a feature label names, in the strategy's order."""
    named = {m.group(1) or m.group(2) for m in _NAMED.finditer(label)}
    if "tensor parallelism" in label or "tensor or pipeline parallelism" in label:
        named.add("tensor_parallel")
    if "pipeline parallelism" in label:
        named.add("pipeline")
    return [s for s in SECTIONS if s in named]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _matrix(rows: Sequence[Conflict]) -> list[str]:
    cells: dict[tuple[str, str], list[int]] = {}
    for number, row in enumerate(rows, 1):
        for a in sections_of(row.a):
            for b in sections_of(row.b):
                for pair in ((a, b), (b, a)) if a != b else ((a, a),):
                    cells.setdefault(pair, []).append(number)
    names = [s for s in SECTIONS if any(s in pair for pair in cells)]
    out = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        row = [", ".join(map(str, cells.get((a, b), []))) for b in names]
        out.append(f"| **{a}** | " + " | ".join(row) + " |")
    return out


def render(rows: Sequence[Conflict] = CONFLICTS) -> str:
    """The markdown page: the section matrix, then the table's rows in order."""
    out = [HEADER, "## Sections that conflict", "",
           "A number is a row of the table below (often only some settings of the two "
           "sections conflict); an empty cell: they combine.", "", *_matrix(rows), "",
           "## Every refused combination", "",
           "| # | Setting | With | Why | Fix | Checked by |", "|---|---|---|---|---|---|"]
    for number, row in enumerate(rows, 1):
        out.append(f"| {number} | {_cell(row.a)} | {_cell(row.b)} | {_cell(row.reason)} | "
                   f"{_cell(row.fix)} | {row.checked_by} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
