"""Reading the Strategy's fields: TOML sources, type coercion and range checks, and
one-line errors that suggest the closest key."""

import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
import types
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Union, get_args, get_origin

from bigbatch.config.limits import INT_LIMIT
from bigbatch.errors import ConfigError


def closest(word: str, options: list[str]) -> str | None:
    """The option most like ``word`` (difflib), or None when nothing is close."""
    found = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_key_message(section: str, key: str, keys: dict[str, list[str]]) -> str:
    """One line for ``section.key`` not being a field, with the best suggestion."""
    msg = f"unknown key {section}.{key}"
    if guess := closest(key, keys[section]):
        return f"{msg}; did you mean `{guess}`?"
    owners = [s for s, names in keys.items() if key in names]
    if owners:
        return f"{msg}; `{key}` belongs in [{owners[0]}]"
    return f"{msg}; valid keys: {', '.join(keys[section])}"


def parse_literal(raw: str) -> Any:
    """A TOML literal (``4``, ``0.5``, ``true``, ``["a"]``, ``"s"``); a bare word stays a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def format_literal(value: Any) -> str:
    """`value` (str, bool, int, float or a list of them) as `parse_literal` reads it back:
    a plain word bare, any other string (and every string in a list) quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(json.dumps(v) if isinstance(v, str) else format_literal(v)
                               for v in value) + "]"
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z_][\w.-]*", value) and parse_literal(value) == value
        return value if plain else json.dumps(value)
    return repr(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(tp: Any) -> str:
    args = get_args(tp)
    if get_origin(tp) in (Union, types.UnionType):
        inner = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or none" if type(None) in args else "")
    if get_origin(tp) in (tuple, list):
        return f"list of {_type_name(args[0])}"
    if get_origin(tp) is dict:
        return "table"
    if tp is os.PathLike:
        return "path"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, shown: Any = None) -> Any:
    """``value`` as type ``tp`` (int accepted for float, bool never for numbers).

    ``shown`` is the declared type named in errors (for an item of a list or an
    optional value, the whole field's type).
    """
    shown = tp if shown is None else shown
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:
            return _coerce(key, value, arms[0], shown)
        for inner in arms:
            try:
                return _coerce(key, value, inner, shown)
            except ConfigError:
                continue
        _wrong(key, value, shown)
    if origin in (tuple, list):
        if isinstance(value, str):  # a bare word from --set, most likely
            if value.lstrip().startswith("["):  # a list whose strings lost their quotes
                raise ConfigError(
                    f"{key}: {_short(value)} is not a TOML list: quote each string, e.g. "
                    f"--set '{key}=[\"a\", \"b\"]' (the outer quotes keep the shell's "
                    f"hands off)")
            raise ConfigError(
                f"{key}: expected a list, got the string {_short(value)}; write "
                f"[\"{value}\"] (on the command line: --set '{key}=[\"{value}\"]')")
        if not isinstance(value, list | tuple):
            _wrong(key, value, shown)
        return origin(_coerce(key, v, args[0], shown) for v in value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            _wrong(key, value, shown)
        return {k: _coerce(f"{key}.{k}", v, args[1], args[1]) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _wrong(key, value, shown)
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
        _wrong(key, value, shown)
    if tp is int and abs(value) > INT_LIMIT:
        raise ConfigError(f"{key}={value} is out of range; allowed: below 2**63")
    return value


def _wrong(key: str, value: Any, tp: Any) -> Any:
    raise ConfigError(
        f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {_short(value)}"
    )


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(rules: dict[str, Any]) -> str:
    lo = ("(", rules["gt"]) if "gt" in rules else ("[", rules["ge"]) if "ge" in rules else None
    hi = (")", rules["lt"]) if "lt" in rules else ("]", rules["le"]) if "le" in rules else None
    if lo and hi:
        return f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {_num(lo[1])}"
    assert hi is not None
    return f"{'<' if hi[0] == ')' else '<='} {_num(hi[1])}"


def _in_range(x: float, rules: dict[str, Any]) -> bool:
    return (
        ("gt" not in rules or x > rules["gt"])
        and ("ge" not in rules or x >= rules["ge"])
        and ("lt" not in rules or x < rules["lt"])
        and ("le" not in rules or x <= rules["le"])
    )


def check_value(key: str, value: Any, tp: Any, rules: Mapping[str, Any] = MappingProxyType({})
                ) -> Any:
    """``value`` of key ``key`` coerced to type ``tp`` and checked against ``rules``:
    ``choices`` (allowed strings) and ``gt``/``ge``/``lt``/``le`` bounds (applied to each
    item of a list). Raises a one-line ConfigError naming the key."""
    value = _coerce(key, value, tp)
    if value is None:
        return None
    if "choices" in rules and value not in rules["choices"]:
        msg = f"{key} must be one of {', '.join(rules['choices'])}; got {value!r}"
        guess = closest(value, list(rules["choices"])) if isinstance(value, str) else None
        raise ConfigError(f"{msg}; did you mean `{guess}`?" if guess else msg)
    bounds = {k: v for k, v in rules.items() if k in ("gt", "ge", "lt", "le")}
    items = value if isinstance(value, tuple | list) else (value,)
    if bounds and any(not _in_range(x, bounds) for x in items):
        raise ConfigError(f"{key} must be {_range_text(bounds)}, got {value!r}")
    return value


def check_fields(obj: Any, section: str, hints: Mapping[str, Any] | None = None) -> None:
    """Type-check, coerce and range-check every field of a dataclass (see `check_value`).

    Rules come from each field's metadata; ``hints`` gives the fields' types where their
    annotations are strings (``from __future__ import annotations``).
    """
    for f in dataclasses.fields(obj):
        tp = hints[f.name] if hints is not None else f.type
        value = check_value(f"{section}.{f.name}", getattr(obj, f.name), tp, f.metadata)
        object.__setattr__(obj, f.name, value)


def read_toml_source(path_or_text: str | os.PathLike) -> tuple[str, str]:
    """(name for messages, TOML text) from a path or from TOML text itself.

    A string is a path when it names an existing file, or when it is one
    non-empty line with no ``=`` and no ``[`` (which no TOML document lacks).
    """
    p = path_or_text
    is_path = isinstance(p, os.PathLike) or (
        isinstance(p, str)
        and (os.path.isfile(p) or (p.strip() and not any(c in p for c in "\n=[")))
    )
    if is_path:
        path = Path(p)
        try:
            return str(path), path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read strategy file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"strategy file {path} is not UTF-8 text (byte "
                              f"{e.object[e.start]:#04x} at offset {e.start})") from None
    if not isinstance(p, str):
        raise ConfigError(f"expected a TOML path or text, got {type(p).__name__}")
    return "<toml text>", p
