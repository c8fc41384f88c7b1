"""Flags and printed output of `bigbatch gns` (the measurement is `bigbatch.gns_probe`).

Re-exported by `bigbatch.gns_probe`, which the CLI and ``python -m bigbatch.gns_probe``
use; nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["GNS_DESCRIPTION", "GNS_HELP", "add_gns_arguments", "format_report"]

GNS_HELP = "measure a task's gradient noise scale (critical batch) over training"
GNS_DESCRIPTION = (
    "Train a built-in task and measure its gradient noise scale B_simple = tr(Sigma)/|G|^2 at "
    "a few points of training; prints each point and the critical-batch estimate with its "
    "uncertainty. Default strategy: the task's small-batch recipe with gradient merge."
)


def _fmt(v: float, spec: str = ".4g") -> str:
    return format(v, spec) if math.isfinite(v) else ("inf" if v == math.inf else "n/a")


def _point_line(p: dict[str, Any]) -> str:
    return (f"step {p['step']:>6} (epoch {p['epoch']:.2f}): loss {p['loss']:.4f}  "
            f"B_simple {_fmt(p['b_simple'])} +- {_fmt(p['stderr'], '.2g')} "
            f"({p['estimates']} steps)")


def format_report(points: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The table of points and the critical-batch line, as `bigbatch gns` prints them."""
    head = f"{'step':>7} {'epoch':>6} {'loss':>8} {'B_simple':>10} {'stderr':>9} " \
           f"{'|G|^2':>10} {'tr(Sigma)':>10}"
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(f"{p['step']:>7} {p['epoch']:>6.2f} {p['loss']:>8.4f} "
                     f"{_fmt(p['b_simple']):>10} {_fmt(p['stderr'], '.3g'):>9} "
                     f"{_fmt(p['sq_norm'], '.3g'):>10} {_fmt(p['trace'], '.3g'):>10}")
    s = summary
    line = (f"critical batch (B_simple at step {s['step']}): {_fmt(s['b_simple'])} "
            f"+- {_fmt(s['stderr'], '.2g')}")
    if math.isfinite(s["low"]):
        line += f" (95%: {_fmt(s['low'])} to {_fmt(s['high'])})"
    line += (f"; over training {_fmt(s['min_over_training'])} to "
             f"{_fmt(s['max_over_training'])} items per batch")
    lines.append(line)
    if s["biased"]:
        lines.append("note: measured from consecutive steps (one worker, no merge): biased")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def add_gns_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `bigbatch gns`'s flags to `parser` (a subparser of the CLI, or a fresh one)."""
    parser.add_argument("--config", metavar="FILE",
                        help="strategy TOML (default: the task's small-batch recipe, merged)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append",
                        default=[], help="override one strategy key (repeatable)")
    parser.add_argument("--task", default="mnist1d", help="built-in task (default mnist1d)")
    parser.add_argument("--model", help="model of the task (default: the task's)")
    parser.add_argument("--task-opt", dest="task_options", metavar="KEY=VALUE", action="append",
                        default=[], help="task option, e.g. num_samples=5000 (repeatable)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps of training")
    length.add_argument("--epochs", type=float, help="epochs of training (default: the recipe's)")
    parser.add_argument("--points", type=int, default=5, help="measurement points (default 5)")
    parser.add_argument("--steps-per-point", type=int, default=50,
                        help="steps averaged per point (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of init and data order")
    parser.add_argument("--json", metavar="FILE", help="also write the points and summary here")
    parser.add_argument("--nproc", type=int, default=1,
                        help="workers on this machine (started through torch.distributed.run)")
    return parser


def _options(items: Sequence[str]) -> dict[str, Any]:
    import tomllib

    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--task-opt {item!r} must look like key=value")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw.strip()
    return out


def _argv_of(args: argparse.Namespace) -> list[str]:
    """`args` back as flags, for the workers a launch starts (without --nproc)."""
    argv: list[str] = []
    for flag in ("config", "task", "model", "steps", "epochs", "points", "steps_per_point",
                 "seed", "json"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    for item in getattr(args, "overrides", []) or []:
        argv += ["--set", item]
    for item in getattr(args, "task_options", []) or []:
        argv += ["--task-opt", item]
    return argv


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v
