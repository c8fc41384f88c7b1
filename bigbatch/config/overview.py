"""The Strategy's overview: a boxed key/value table in the style of Fleet's
`DistributedStrategy` printout."""

from __future__ import annotations

from typing import Any

__all__ = ["render_overview"]

WIDTH = 80
_KEY_COL = 36  # keys right-aligned in this many columns, then a gap, then the value
_GAP = 4


def _text(value: Any) -> list[str]:
    """Display lines of one value: TOML-like scalars, one line per list item."""
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if value is None:
        return ["-"]
    if isinstance(value, tuple | list):
        return [str(v) for v in value] or ["[]"]
    return [str(value)]


def _line(text: str, align: str = "^") -> str:
    inner = WIDTH - 2
    if len(text) > inner:
        text = text[: inner - 3] + "..."
    return f"|{text:{align}{inner}}|"


def render_overview(title: str, blocks: list[tuple[str, list[tuple[str, Any]]]]) -> str:
    """A Fleet-style boxed table: a title, then one titled block of key/value rows each."""
    heavy, light = "+" + "=" * (WIDTH - 2) + "+", "+" + "-" * (WIDTH - 2) + "+"
    out = [heavy, _line(""), _line(title), _line(""), heavy]
    value_width = WIDTH - 2 - _KEY_COL - _GAP
    for block_title, rows in blocks:
        out += [_line(block_title), light]
        for key, value in rows:
            for i, item in enumerate(_text(value)):
                if len(item) > value_width:
                    item = item[: value_width - 3] + "..."
                label = key if i == 0 else ""
                out.append(_line(f"{label:>{_KEY_COL}}{'':{_GAP}}{item}", "<"))
        out.append(heavy)
    return "\n".join(out)
