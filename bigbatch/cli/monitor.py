"""`bigbatch monitor OUT [--png] [--once] [--interval S]`: watch a running or finished job."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

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


def run_monitor_command(args: argparse.Namespace) -> int:
    from bigbatch.train.monitor import read_run, render

    out = Path(args.out)
    if not out.is_dir():
        raise ConfigError(f"{out} is not a directory")
    view = read_run(out)
    if view.updated is None and view.summary is None:
        raise ConfigError(f"{out} has no metrics.jsonl (is it a `bigbatch train` "
                          "--out directory?)")
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
