"""Relaunching a job that a policy stopped to change what a resume may change but the
running job cannot change in place (`Policies.request_relaunch`: a switch to
``data_parallel.reduce = "powersgd"``, say).

The workers checkpoint, record a ``kind = "relaunch"`` line in ``metrics.jsonl`` and the
keys in ``OUT/stopped.json``, and exit 0. The launcher (`bigbatch train --nproc N`, or the
autoscaler's segments of ``MIN:MAX``) then resumes the job from that checkpoint with
``--resume --set KEY=VALUE`` for each key, through the same torchrun launch, exactly as
a user would by hand; the resume's own checks (`bigbatch.train.resume`) decide whether the
change is allowed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MAX_RELAUNCHES", "relaunch_args", "relaunch_requested", "run_relaunching"]

MAX_RELAUNCHES = 100
"""Relaunches one launch follows at most (a policy asking at every start would loop)."""


def relaunch_requested(out: str | Path, since: float) -> tuple[dict[str, Any], int] | None:
    """(keys, step) of a relaunch the job asked for since `since` (`time.time()`), taken:
    a later call does not see it again."""
    from bigbatch.train.stopped import take_relaunch

    return take_relaunch(out, since)


def relaunch_args(args: argparse.Namespace, argv: list[str], keys: dict[str, Any],
                  step: int) -> list[str]:
    """Set `args` for the resume with `keys` and return its command line (`argv` without
    ``--resume``/``--overwrite``, then ``--resume --set KEY=VALUE ...``); say so on stderr."""
    from bigbatch.config.fields import format_literal

    sets = [f"{k}={format_literal(v)}" for k, v in keys.items()]
    args.overrides = [*getattr(args, "overrides", []), *sets]
    args.resume, args.overwrite = True, False
    print(f"bigbatch train: relaunching from the checkpoint at step {step} with "
          + " ".join(f"--set {s}" for s in sets), file=sys.stderr, flush=True)
    kept = [a for a in argv if a not in ("--resume", "--overwrite")]
    return [*kept, "--resume", *(x for s in sets for x in ("--set", s))]


def run_relaunching(args: argparse.Namespace, argv: list[str], config: Any, strategy: Any,
                    resolve: Callable[[argparse.Namespace], tuple[Any, Any]],
                    launch: Callable[..., int]) -> int:
    """`launch(args, argv, config, strategy)`, then again from the checkpoint for every
    relaunch the job asks for; the last launch's status."""
    for _ in range(MAX_RELAUNCHES + 1):
        started = time.time()
        status = launch(args, argv, config, strategy)
        asked = relaunch_requested(config.out, started) if status == 0 else None
        if asked is None:
            return status
        argv = relaunch_args(args, argv, *asked)
        config, strategy = resolve(args)
    print(f"bigbatch train: stopped after {MAX_RELAUNCHES} relaunches", file=sys.stderr)
    return 1
