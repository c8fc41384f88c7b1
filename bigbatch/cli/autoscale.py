"""`bigbatch train --nproc MIN:MAX`: one job that picks its own worker count.

The launcher runs the job in *segments* through the same in-process torchrun launch as
`--nproc N` (`bigbatch.cli.train`'s launch, passed in): each segment runs at one size for
``--autoscale-steps`` optimizer steps, its workers time the steps and stop after a
checkpoint (`bigbatch.adaptive.autoscale.AutoscaleSegment`), and the next segment resumes
from that checkpoint at the size the rule chose (`Autoscaler`: grow by
``--autoscale-step`` while the marginal scaling efficiency stays at or above
``--autoscale-threshold`` and goodput improves; otherwise go back to the best size
measured and stay; with ``--autoscale-rule model``, once three sizes are measured, Pollux's
throughput model fitted to them predicts every other size, the job jumps to the predicted
best when it beats the best measured by more than ``--autoscale-margin`` and never measures
the sizes predicted to lose). A resume at another size is exact and follows ``batch.elastic``
(keep: the same global batch, re-split; scale: the batch grows with the workers). A
segment that loses a worker continues one size smaller from its last checkpoint.

Every decision is a ``kind = "autoscale"`` line of ``metrics.jsonl`` with the numbers it
was made on (samples/s by size, the marginal efficiency; under the model rule the
predicted samples/s and goodput by size and the prediction for the size just measured), a
line on stderr, and an event in
`bigbatch monitor`; ``OUT/autoscale.json`` holds the whole history. Multi-node (`--nnodes`)
is not driven here: torchrun's own ``--nnodes MIN:MAX`` stays the way to change machines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["AUTOSCALE_FILE", "add_autoscale_arguments", "parse_range", "run_autoscaled"]

AUTOSCALE_FILE = "autoscale.json"
_STEPS, _THRESHOLD, _STEP, _SKIP, _MARGIN = 20, 0.5, 1, 2, 0.05


def parse_range(text: str) -> tuple[int, int] | None:
    """``"MIN:MAX"`` -> (MIN, MAX); None when `text` is not a range. A malformed range is a
    ConfigError naming the flag and what is allowed."""
    if ":" not in text:
        return None
    lo, _, hi = text.partition(":")
    if not (lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi):
        raise ConfigError(f"--nproc {text}: expected N or MIN:MAX with integers "
                          "1 <= MIN <= MAX")
    return int(lo), int(hi)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number in [0, 1]")
    return v


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return int(text)


def add_autoscale_arguments(group: Any) -> None:
    """The autoscaler's flags (used with ``--nproc MIN:MAX``)."""
    group.add_argument("--autoscale-steps", type=_count, metavar="N",
                       help=f"with --nproc MIN:MAX: optimizer steps measured at each size "
                       f"(default {_STEPS}; the first {_SKIP} are not timed)")
    group.add_argument("--autoscale-threshold", type=_fraction, metavar="F",
                       help="with --nproc MIN:MAX: the marginal scaling efficiency a growth "
                       f"must keep, in [0, 1] (default {_THRESHOLD})")
    group.add_argument("--autoscale-step", type=_count, metavar="K",
                       help=f"with --nproc MIN:MAX: workers added per growth (default {_STEP})")
    group.add_argument("--autoscale-rule", choices=("step", "model"), default="step",
                       help="with --nproc MIN:MAX: step (default): measure each size in turn; "
                       "model: once three sizes are measured, predict the others with Pollux's "
                       "throughput model, jump to the predicted best and skip sizes predicted "
                       "to lose (every size it settles on is measured)")
    group.add_argument("--autoscale-margin", type=_fraction, metavar="F",
                       help="with --autoscale-rule model: the predicted goodput gain over the "
                       f"best measured size that a jump needs, in [0, 1] (default {_MARGIN})")


def _segment_argv(argv: list[str], resume: bool) -> list[str]:
    out = [a for a in argv if a not in ("--resume", "--overwrite")]
    return [*out, "--resume"] if resume else out


def _read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def run_autoscaled(args: argparse.Namespace, argv: list[str], lo: int, hi: int,
                   resolve: Callable[[argparse.Namespace], tuple[Any, Any]],
                   launch: Callable[..., int]) -> int:
    """Run the job in measured segments between `lo` and `hi` workers (see the module
    docstring). `resolve(args)` makes (config, strategy); `launch(args, argv, config,
    strategy)` runs one torchrun job of ``args.nproc`` workers and returns its status."""
    from bigbatch.adaptive.autoscale import SKIP_ENV, UNTIL_ENV, Autoscaler, Measurement
    from bigbatch.cli.relaunch import relaunch_args, relaunch_requested
    from bigbatch.train.progress import METRICS_FILE

    if args.nnodes is not None or args.rdzv_endpoint is not None:
        raise ConfigError("--nproc MIN:MAX drives the workers of this machine; with --nnodes or "
                          "--rdzv-endpoint give --nproc N and torchrun's --nnodes MIN:MAX")
    steps = args.autoscale_steps or _STEPS
    threshold = _THRESHOLD if args.autoscale_threshold is None else args.autoscale_threshold
    margin = _MARGIN if args.autoscale_margin is None else args.autoscale_margin
    rule: Autoscaler | None = None  # made with the first segment's strategy
    history: list[dict[str, Any]] = []
    n, resume, settled, losses = lo, bool(args.resume), False, 0
    first = True
    out = Path(args.out)
    metrics = out / METRICS_FILE
    saved_env = {k: os.environ.get(k) for k in (UNTIL_ENV, SKIP_ENV)}
    try:
        while True:
            args.nproc, args.resume = n, resume
            args.overwrite = bool(args.overwrite) and first
            try:
                config, strategy = resolve(args)
            except ConfigError as e:
                if first:
                    raise
                decision, step = rule.cannot_start(n, str(e)), _last_step(metrics)
                n, settled = _decided(decision, step, history, metrics, out)
                continue
            if rule is None:
                rule = Autoscaler(lo, hi, step=args.autoscale_step or _STEP,
                                  threshold=threshold, rule=args.autoscale_rule, margin=margin,
                                  plan=lambda n, last, s=strategy: _plan_at(s, n, last),
                                  base_batch_size=strategy.batch.base_batch_size)
            out = Path(config.out)
            metrics = out / METRICS_FILE
            start = _last_step(metrics) if resume else 0
            until = None if settled else start + steps
            if until is None:
                os.environ.pop(UNTIL_ENV, None)
            else:
                os.environ[UNTIL_ENV], os.environ[SKIP_ENV] = str(until), str(_SKIP)
            started = time.time()
            status = launch(args, _segment_argv(argv, resume), config, strategy)
            first, resume = False, True
            found = [r for r in _read_lines(metrics) if r.get("kind") == "autoscale_measure"
                     and until is not None and r.get("step") == until]
            asked = relaunch_requested(out, started) if status == 0 else None
            if asked is not None:  # a policy's change through the checkpoint: same size
                argv = relaunch_args(args, argv, *asked)
                if not found:
                    continue
            if status == 0 and found:
                r = found[-1]
                decision = rule.observe(Measurement(
                    int(r["world_size"]), _number(r.get("samples_per_s")), int(r["step"]),
                    int(r.get("global_batch_size", 0)), float(r.get("efficiency", 1.0)),
                    micro_batch_size=int(r.get("micro_batch_size", 0)),
                    k_steps=int(r.get("k_steps", 1)),
                    noise_scale=_number(r.get("noise_scale"))))
                step = int(r["step"])
            elif status == 0:
                _summary(out, history)
                return 0  # the run ended (its length reached) inside this segment
            elif status == 2 and n != lo and _last_step(metrics) == start:
                # refused before its first step (a batch that does not split over n, say)
                decision, step = rule.cannot_start(n, f"its segment exited 2 at step {start}"), start
            elif status == 1 and losses < hi and _last_step(metrics) > start:
                losses += 1
                decision, step = rule.lost_worker(n), _last_step(metrics)
            else:
                return status
            n, settled = _decided(decision, step, history, metrics, out)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _number(value: Any) -> float:
    """A record's number; NaN where metrics.jsonl wrote null (a NaN) or nothing."""
    return float(value) if isinstance(value, int | float) else math.nan


def _plan_at(strategy: Any, n: int, last: Any) -> tuple[int, int] | None:
    """The (micro, k_steps) a segment at `n` workers resumes with after the segment that
    measured `last` (`bigbatch.config.elastic.resume_plan`); None when it cannot."""
    from bigbatch.config.elastic import BatchState, configured_sizes, resume_plan

    saved = BatchState(last.global_batch_size, last.micro_batch_size, last.k_steps,
                       last.world_size, last.global_batch_size, configured_sizes(strategy))
    try:
        plan = resume_plan(strategy, n, saved)
    except ConfigError:
        return None
    return plan.micro_batch_size, plan.k_steps


def _decided(decision: Any, step: int, history: list[dict[str, Any]], metrics: Path,
             out: Path) -> tuple[int, bool]:
    """Record `decision` (metrics.jsonl, autoscale.json, one stderr line); the size it
    chose and whether that size is final."""
    rec = decision.record(step)
    history.append(rec)
    _append(metrics, rec)
    line = (f"bigbatch train: autoscale at step {step}: {decision.reason}; measured "
            + ", ".join(f"{k} worker(s) {v:.4g} samples/s"
                        for k, v in decision.measured.items()))
    if decision.predicted:
        line += "; predicted " + ", ".join(
            f"{k} worker(s) {v:.4g} samples/s (goodput {decision.predicted_goodput[k]:.4g})"
            for k, v in decision.predicted.items())
    print(line, file=sys.stderr, flush=True)
    _write_history(out, history)
    return decision.new, decision.settled


def _last_step(metrics: Path) -> int:
    steps = [r.get("step") for r in _read_lines(metrics)]
    return max((int(s) for s in steps if isinstance(s, int | float)), default=0)


def _write_history(out: Path, history: list[dict[str, Any]]) -> None:
    """`OUT/autoscale.json`, recorded among the run's files first (so `--overwrite`
    removes it with the rest), written atomically."""
    from bigbatch.train.checkpoint import write_text_atomic
    from bigbatch.train.outdir import RunFiles

    files = RunFiles.read(out)
    if files is not None:
        files.add(out / AUTOSCALE_FILE)
    write_text_atomic(out / AUTOSCALE_FILE, json.dumps({"decisions": history}, indent=1) + "\n")


def _summary(out: Path, history: list[dict[str, Any]]) -> None:
    if not history:
        return
    last = history[-1]
    print(f"bigbatch train: autoscale: ran at {last['new']} worker(s) since step "
          f"{last['step']} ({last['reason']})", file=sys.stderr, flush=True)
