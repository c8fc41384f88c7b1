"""`bigbatch lr-find`: the LR range test of a built-in task at the strategy's global batch.

One process; the global batch is reached by gradient merge. Writes `OUT/lr_find.json`
and `OUT/lr_find.png` and prints the suggestion (see `bigbatch.study.lr_find`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bigbatch.cli.argtypes import add_task_arguments, task_options
from bigbatch.errors import ConfigError

__all__ = ["LR_FIND_DESCRIPTION", "LR_FIND_HELP", "add_lr_find_arguments",
           "run_lr_find_command"]

LR_FIND_HELP = "LR range test at the target global batch: suggest base_lr and its scaling rule"
LR_FIND_DESCRIPTION = (
    "Train a built-in task for a few hundred steps with the learning rate growing "
    "exponentially, at the strategy's global batch (one process, gradient merge), and "
    "suggest the peak LR (the smoothed loss's minimum before divergence over a safety "
    "factor, or none when the curve shows no clear descent); says which scaling rule "
    "(linear, sqrt) that LR implies from the recipe's base batch and LR.")


def add_lr_find_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_task_arguments(parser, "strategy TOML (default: the task's demo strategy)")
    parser.add_argument("--steps", type=int, default=200, help="sweep steps (default 200)")
    parser.add_argument("--min", dest="lr_min", type=float, default=1e-5,
                        help="first LR (default 1e-5)")
    parser.add_argument("--max", dest="lr_max", type=float, default=10.0,
                        help="last LR (default 10)")
    parser.add_argument("--smoothing", type=float, default=None,
                        help="plot an exponential moving average with this weight of the past, "
                        "in [0, 1) (fastai's 0.98), instead of the centred average the "
                        "suggestion reads (default; it does not lag on short sweeps)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", default="runs/lr-find", help="output folder "
                        "(default runs/lr-find)")
    return parser


def _check(args: argparse.Namespace) -> None:
    if not 2 <= args.steps <= 100_000:
        raise ConfigError(f"--steps={args.steps} is out of range; allowed: [2, 100000]")
    for name in ("lr_min", "lr_max"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name[3:]}={value} is out of range; allowed: > 0, finite")
    if args.smoothing is not None and not 0 <= args.smoothing < 1:
        raise ConfigError(f"--smoothing={args.smoothing} is out of range; allowed: [0, 1)")
    if args.lr_min >= args.lr_max:
        raise ConfigError(f"--min={args.lr_min} must be below --max={args.lr_max}")
    if not 0 <= args.seed < 2**31:
        raise ConfigError(f"--seed={args.seed} is out of range; allowed: [0, 2^31)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")


def run_lr_find_command(args: argparse.Namespace) -> int:
    """`bigbatch lr-find`; returns the exit code, raises ConfigError on user mistakes."""
    import torch

    from bigbatch.config.strategy import Strategy
    from bigbatch.engine.prepare import prepare
    from bigbatch.parallel.world import World
    from bigbatch.study.lr_find import lr_find, plot_lr_find
    from bigbatch.tasks import get_task
    from bigbatch.tasks.sampler import GlobalBatchSampler
    from bigbatch.train.data import seed_everything
    from bigbatch.train.lr_phase import endless, task_step

    _check(args)
    task = get_task(args.task, **task_options(args.task_options))
    model_name = task.check_model(args.model)
    strategy = (Strategy.from_toml(Path(args.config)) if args.config is not None
                else Strategy.from_toml(task.demo_strategy)).with_overrides(args.overrides)
    plan = strategy.resolve(1)  # a growing batch's start: where its LR is found
    strategy = strategy.with_overrides(["batch.schedule=fixed", "batch.start_batch_size=none"])
    if plan.global_batch_size > len(task.train_set):
        raise ConfigError(f"global batch {plan.global_batch_size} is larger than the training "
                          f"set ({len(task.train_set)} samples)")
    seed_everything(args.seed)
    world = World()
    # The sweep stops at a diverging loss itself: no nan_policy.
    run = prepare(task.build_model(model_name), strategy, total_steps=args.steps, world=world,
                  plan=plan, steps_per_epoch=max(1, len(task.train_set) // plan.global_batch_size),
                  nan_policy=None)
    sampler = GlobalBatchSampler(len(task.train_set), plan.global_batch_size,
                                 plan.micro_batch_size, 1, 0, args.seed)

    with torch.random.fork_rng():
        result = lr_find(run, endless(sampler), task_step(task, world.device),
                         lr_min=args.lr_min, lr_max=args.lr_max,
                         steps=args.steps, smoothing=args.smoothing)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lr_find.json").write_text(json.dumps(
        {"task": task.name, "model": model_name, **result.to_dict()}, indent=2) + "\n")
    plot_lr_find(result, out / "lr_find.png")
    print(result.summary())
    print(f"wrote {out / 'lr_find.json'} and {out / 'lr_find.png'}")
    return 0
