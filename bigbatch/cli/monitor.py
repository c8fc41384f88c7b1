"""`bigbatch monitor OUT [--png] [--once] [--interval S]`: watch a running or finished job."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bigbatch.cli.argtypes import positive_float
from bigbatch.errors import ConfigError

__all__ = ["MONITOR_DESCRIPTION", "MONITOR_HELP", "add_monitor_arguments", "run_monitor_command"]

MONITOR_HELP = "watch a training run: loss, LR, batch, noise scale, per-rank step times"
MONITOR_DESCRIPTION = (
    "A live terminal view of OUT/metrics.jsonl, refreshed until the run finishes (or once "
    "for a finished run): loss, learning rate, global batch, noise scale, trust-ratio spread "
    "and per-rank step times with stragglers marked. --png writes the same as OUT/monitor.png.")


def add_monitor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT", help="the run's output directory (train --out)")
    p.add_argument("--png", action="store_true", help="write OUT/monitor.png and exit")
    p.add_argument("--once", action="store_true", help="print the view once and exit")
    p.add_argument("--interval", type=positive_float, default=2.0, metavar="S",
                   help="seconds between refreshes of a running job (default 2)")
    p.add_argument("--wait", type=positive_float, default=WAIT_S, metavar="S",
                   help="seconds to wait for a run that is starting to write its first "
                   f"metrics (default {WAIT_S:g})")


WAIT_S = 60.0
"""How long `monitor` waits, by default, for a starting run's metrics.jsonl: a run writes it
once its data, model and first checks are ready (seconds; longer for a large data set)."""


def _wait_for_run(out: Path, seconds: float, poll: float = 0.5) -> Any:
    """The run's view once `out` holds metrics (or a summary); waits up to `seconds` for a
    run that is starting, saying so once on stderr. ConfigError when none appears."""
    from bigbatch.train.monitor import read_run

    view = read_run(out) if out.is_dir() else None
    if view is not None and (view.updated is not None or view.summary is not None):
        return view
    print(f"bigbatch monitor: waiting up to {seconds:g} s for a run to start writing "
          f"{out / 'metrics.jsonl'}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        if out.is_dir():
            view = read_run(out)
            if view.updated is not None or view.summary is not None:
                return view
    if not out.is_dir():
        raise ConfigError(f"{out} is not a directory (no run started there within "
                          f"{seconds:g} s)")
    raise ConfigError(f"{out} has no metrics.jsonl after {seconds:g} s (is it a `bigbatch "
                      "train` --out directory? --wait S waits longer)")


def run_monitor_command(args: argparse.Namespace) -> int:
    from bigbatch.train.monitor import read_run, render

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is not a directory")
    view = _wait_for_run(out, args.wait)
    if args.png:
        from bigbatch.train.monitor_figure import write_figure

        print(write_figure(view))
        return 0
    from rich.console import Console

    console = Console()
    if args.once or view.finished or not console.is_terminal:
        console.print(render(view))
        return 0
    from rich.live import Live

    try:
        with Live(render(view), console=console, refresh_per_second=4) as live:
            while not view.finished:
                time.sleep(args.interval)
                view = read_run(out)
                live.update(render(view))
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0
