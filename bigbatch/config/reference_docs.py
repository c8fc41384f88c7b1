"""`docs/strategy-keys.md`, rendered from the typed config: every section of a `Strategy`
and every key, with its type, default, allowed values and the docstring under the field.

    python -m bigbatch.config.reference_docs > docs/strategy-keys.md

A test compares the committed page with this output, so the reference cannot drift from
the dataclasses that validate the keys.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from functools import cache
from typing import Any

from bigbatch.config.fields import _type_name
from bigbatch.config.sections import SECTIONS
from bigbatch.config.strategy import FILE_KEYS, Strategy

__all__ = ["field_docs", "render"]

HEADER = """\
# Strategy keys: the reference

<!-- Generated from the section dataclasses in bigbatch/config/ by
`python -m bigbatch.config.reference_docs`; edit the docstrings there, not this page
(tests/test_docs_site.py checks it). -->

A strategy is a TOML file (or `bigbatch.Strategy.from_toml(text)`,
`Strategy.from_dict({...})`) with one table per section. Section and key names follow
PaddlePaddle Fleet's `DistributedStrategy`. A section that is present switches its
feature on (`enable = false` switches it off again); a key left out takes the default
below. Every value is checked when the strategy is read: an unknown key, a wrong type or
a value out of range is one line naming the key and what is allowed. Which sections
cannot go together is [the compatibility table](compatibility.md); how the batch sizes
and the LR are derived is [the strategy guide](strategy.md).

On the command line, `--set section.key=value` overrides one key of the strategy
(`--set lars.lars_coeff=0.01`, `--set amp.dtype=bfloat16`).
"""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls` (PEP 257 attribute
    docstrings, read from its source), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # the class statement's body
    out: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            out[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return out


def _value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return repr(value)


def _allowed(metadata: Any) -> str:
    rules = []
    if "choices" in metadata:
        rules.append(" \\| ".join(_value(c) for c in metadata["choices"]))
    for rule, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if rule in metadata:
            rules.append(f"{sign} {metadata[rule]:g}")
    return ", ".join(rules)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _section(name: str, cls: type, summary: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
    out = [f"## [{name}]", "", summary, "", doc, "",
           "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        out.append(f"| `{f.name}` | {_cell(_type_name(hints[f.name]))} | "
                   f"`{_value(_default(f))}` | {_allowed(f.metadata)} | "
                   f"{_cell(docs.get(f.name, ''))} |")
    return [*out, ""]


def render() -> str:
    """The markdown page: the sections in the strategy's order, one table each."""
    summaries = field_docs(Strategy)
    index = ", ".join(f"[`[{name}]`](#{name})" for name in SECTIONS)
    out = [HEADER, f"Sections: {index}.", ""]
    top = "; ".join(f"`{key}`: {doc}" for key, doc in FILE_KEYS.items())
    out += [f"Keys outside any section (read by `bigbatch train`, ignored by the library): "
            f"{top}.", ""]
    for name, cls in SECTIONS.items():
        summary = summaries.get(name, "").partition(": ")[2] or f"[{name}]"
        out += _section(name, cls, summary[0].upper() + summary[1:])
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
