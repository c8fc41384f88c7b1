"""argparse value types shared by the commands: each names the bad value in one line."""

from __future__ import annotations

import argparse


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonneg_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def literal(raw: str):
    """A TOML literal (`5000`, `0.1`, `true`, `"x"`), or else the bare word as a string."""
    import tomllib

    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def task_options(items: list[str]) -> dict:
    """`--task-opt key=value ...` as a dict of TOML literals; ConfigError names a bad item."""
    from bigbatch.errors import ConfigError

    options = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--task-opt {item!r} must look like key=value")
        options[key.strip()] = literal(raw.strip())
    return options
