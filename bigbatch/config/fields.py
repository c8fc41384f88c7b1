"""Reading the Strategy's fields: TOML sources, type coercion and range checks, and
one-line errors that suggest the closest key."""

import dataclasses
import difflib
import math
import os
import tomllib
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(tp: Any) -> str:
    args = get_args(tp)
    if get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} or none"
    if get_origin(tp) is tuple:
        return f"list of {_type_name(args[0])}"
    return tp.__name__


def _coerce(key: str, value: Any, tp: Any, shown: Any = None) -> Any:
    """``value`` as type ``tp`` (int accepted for float, bool never for numbers).

    ``shown`` is the declared type named in errors (for an item of a list or an
    optional value, the whole field's type).
    """
    shown = tp if shown is None else shown
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner, shown)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            _wrong(key, value, shown)
        return tuple(_coerce(key, v, args[0], shown) for v in value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _wrong(key, value, shown)
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
        _wrong(key, value, shown)
    return value


def _wrong(key: str, value: Any, tp: Any) -> Any:
    raise ConfigError(
        f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {_short(value)}"
    )


def _range_text(rules: dict[str, Any]) -> str:
    lo = ("(", rules["gt"]) if "gt" in rules else ("[", rules["ge"]) if "ge" in rules else None
    hi = (")", rules["lt"]) if "lt" in rules else ("]", rules["le"]) if "le" in rules else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {lo[1]:g}"
    assert hi is not None
    return f"{'<' if hi[0] == ')' else '<='} {hi[1]:g}"


def _in_range(x: float, rules: dict[str, Any]) -> bool:
    return (
        ("gt" not in rules or x > rules["gt"])
        and ("ge" not in rules or x >= rules["ge"])
        and ("lt" not in rules or x < rules["lt"])
        and ("le" not in rules or x <= rules["le"])
    )


def check_fields(obj: Any, section: str) -> None:
    """Type-check, coerce and range-check every field of a frozen section dataclass.

    Rules come from each field's metadata: ``choices`` for strings, and
    ``gt``/``ge``/``lt``/``le`` bounds for numbers (applied to each item of a list).
    """
    for f in dataclasses.fields(obj):
        key = f"{section}.{f.name}"
        value = _coerce(key, getattr(obj, f.name), f.type)
        object.__setattr__(obj, f.name, value)
        rules = dict(f.metadata)
        if value is None:
            continue
        if "choices" in rules and value not in rules["choices"]:
            msg = f"{key} must be one of {', '.join(rules['choices'])}; got {value!r}"
            guess = closest(value, list(rules["choices"]))
            raise ConfigError(f"{msg}; did you mean `{guess}`?" if guess else msg)
        bounds = {k: v for k, v in rules.items() if k in ("gt", "ge", "lt", "le")}
        items = value if isinstance(value, tuple) else (value,)
        if bounds and any(not _in_range(x, bounds) for x in items):
            raise ConfigError(f"{key} must be {_range_text(bounds)}, got {value!r}")


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
    if not isinstance(p, str):
        raise ConfigError(f"expected a TOML path or text, got {type(p).__name__}")
    return "<toml text>", p
