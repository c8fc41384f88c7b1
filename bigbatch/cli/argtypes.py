"""argparse value types shared by the commands: each names the bad value in one line and
checks its range (`bigbatch.config.limits`): no flag takes inf, nan or an overflow."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn

from bigbatch.config.limits import MAX_COUNT, MAX_EPOCHS, MAX_TIMEOUT_S, SEED_RULE

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (exit 2), not the usage block,
    and which takes no abbreviated flags: with them a mistyped ``--lr 0.1`` would be read
    as ``--lr-find`` and the error would name the stray value instead of the flag."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def number(text: str) -> float:
    """A finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _at_most(value: float, high: float) -> float:
    if value > high:
        shown = (str(v) if isinstance(v, int) else f"{v:g}" for v in (high, value))
        raise argparse.ArgumentTypeError("must be <= {}, got {}".format(*shown))
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return int(_at_most(value, MAX_COUNT))


def nonneg_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return int(_at_most(value, MAX_COUNT))


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def nonneg_float(text: str) -> float:
    value = number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def epochs(text: str) -> float:
    """Training length in epochs: > 0 and finite, at most `MAX_EPOCHS`."""
    return _at_most(positive_float(text), MAX_EPOCHS)


def timeout(text: str) -> float:
    """Seconds: > 0, at most `MAX_TIMEOUT_S` (a week)."""
    return _at_most(positive_float(text), MAX_TIMEOUT_S)


def seed(text: str) -> int:
    """A seed: an integer in numpy's range [0, 2**32 - 1]."""
    value = _integer(text)
    if not SEED_RULE["ge"] <= value <= SEED_RULE["le"]:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32 - 1], got {value}")
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


def add_task_arguments(parser: argparse.ArgumentParser, config_help: str) -> None:
    """The flags every task command shares: --config, --set, --task, --model, --task-opt."""
    parser.add_argument("--config", metavar="FILE", help=config_help)
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append",
                        default=[], help="override one strategy key (repeatable)")
    parser.add_argument("--task", default="mnist1d", help="built-in task (default mnist1d)")
    parser.add_argument("--model", help="model of the task (default: the task's)")
    parser.add_argument("--task-opt", dest="task_options", metavar="KEY=VALUE", action="append",
                        default=[], help="task option, e.g. num_samples=5000 (repeatable)")
