"""`bigbatch plan`: lay a built-in task's run out for N GPUs without N GPUs.

The model is built on the meta device (no weights), the strategy's layout is applied by
the engine's own steps on torch's fake process group of N ranks, and the plan reports per
rank memory, traffic per step, the pipeline bubble and the batch arithmetic (see
`bigbatch.planner`). A layout `bigbatch train` would refuse is refused the same way: one
line, exit 2. Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bigbatch.cli.argtypes import add_task_arguments, positive_float, positive_int, task_options

__all__ = ["PLAN_DESCRIPTION", "PLAN_HELP", "add_plan_arguments", "plan_strategy",
           "run_plan_command"]

PLAN_HELP = "lay a run out for N GPUs: memory per rank, traffic per step, pipeline bubble"
PLAN_DESCRIPTION = (
    "Build a task's model on the meta device, apply the strategy's layout (mesh, tensor "
    "plan, FSDP units, pipeline split) for --world ranks on torch's fake process group, and "
    "report each rank's parameter, gradient, optimizer and activation bytes, the bytes each "
    "step hands to all-gather, reduce-scatter, all-reduce and point-to-point per mesh "
    "dimension, the pipeline bubble and global = micro x accumulation x data. Without "
    "--config the strategy is the task's demo strategy with one sample per data rank per "
    "micro-step (set batch.global_batch_size or batch.micro_batch_size to change it).")


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_task_arguments(parser, "strategy TOML (default: the task's demo strategy, one sample "
                               "per data rank per micro-step)")
    parser.add_argument("--world", type=positive_int, required=True,
                        help="number of GPUs (ranks) to plan for")
    parser.add_argument("--gpu-memory", type=positive_float, metavar="GIB",
                        help="memory of one GPU in GiB (2^30 bytes): say whether the plan fits")
    parser.add_argument("--suggest", action="store_true",
                        help="also plan the layouts of this world (tensor 1-8, pipeline 1-8, "
                             "ZeRO 0-3) and list those that fit, least traffic first")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def plan_strategy(args: argparse.Namespace, demo: str):
    """The strategy to plan: `--config`, or the task's demo strategy without its batch size;
    then `--set`; one sample per micro-step when no batch size is left."""
    from bigbatch.config.strategy import Strategy

    if args.config is not None:
        return Strategy.from_toml(Path(args.config)).with_overrides(args.overrides)
    strategy = Strategy.from_toml(demo).with_overrides(
        ["batch.global_batch_size=none", *args.overrides])
    b = strategy.batch
    if b.global_batch_size is None and b.micro_batch_size is None and not (
            strategy.pipeline.enable and strategy.pipeline.micro_batch_size):
        strategy = strategy.with_overrides(["batch.micro_batch_size=1"])
    return strategy


def run_plan_command(args: argparse.Namespace) -> int:
    """`bigbatch plan`; returns the exit code, raises ConfigError on user mistakes."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bigbatch.planner.planning import plan_task
    from bigbatch.planner.report import render_suggestions
    from bigbatch.tasks import get_task

    task = get_task(args.task, **task_options(args.task_options))
    model = task.check_model(args.model)
    strategy = plan_strategy(args, task.demo_strategy)
    planned = plan_task(task, strategy, args.world, model=model, gpu_memory=args.gpu_memory)
    rows, tried = [], 0
    if args.suggest:
        from bigbatch.planner.suggest import suggest

        rows, tried = suggest(strategy, args.world, lambda s, probes: plan_task(
            task, s, args.world, model=model, gpu_memory=args.gpu_memory, probes=probes,
            ends_only=True),
            args.gpu_memory)
    if args.json:
        out = {"task": task.name, "model": model, **planned.to_dict()}
        if args.suggest:
            out["suggestions"] = [{"set": sets, "mesh": p.mesh, "zero_stage": p.degrees.stage,
                                   "peak": p.worst.peak,
                                   "comm_sent_bytes_per_step": p.to_dict()[
                                       "comm_sent_bytes_per_step"], "bubble": p.bubble}
                                  for p, sets in rows]
            out["suggestions_tried"] = tried
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"bigbatch plan: task {task.name} ({model}), {planned.summary()}")
    if args.suggest:
        print()
        print(render_suggestions(rows, args.gpu_memory, tried))
    return 0
