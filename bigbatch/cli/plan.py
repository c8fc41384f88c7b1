"""`bigbatch plan`: lay a built-in task's run (or your own model's, `--model
module:function`) out for N GPUs without N GPUs, and predict its step time.

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

PLAN_HELP = ("lay a run out for N GPUs: memory per rank, traffic per step, pipeline bubble, "
             "predicted step time")
PLAN_DESCRIPTION = (
    "Build a task's model on the meta device, apply the strategy's layout (mesh, tensor "
    "plan, FSDP units, pipeline split) for --world ranks on torch's fake process group, and "
    "report each rank's parameter, gradient, optimizer and activation bytes, the bytes each "
    "step hands to all-gather, reduce-scatter, all-reduce and point-to-point per mesh "
    "dimension, the pipeline bubble and global = micro x accumulation x data, and predict "
    "the step time on --device (compute, exposed communication per dimension, bubble, "
    "optimizer), tokens or samples per second per device and MFU. Without "
    "--config the strategy is the task's demo strategy with one sample per data rank per "
    "micro-step (set batch.global_batch_size or batch.micro_batch_size to change it).")


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_task_arguments(parser, "strategy TOML (default: the task's demo strategy, one sample "
                               "per data rank per micro-step)")
    parser.add_argument("--world", type=positive_int,
                        help="number of GPUs (ranks) to plan for (required but with "
                             "--calibrate)")
    parser.add_argument("--gpu-memory", type=positive_float, metavar="GIB",
                        help="memory of one GPU in GiB (2^30 bytes): say whether the plan fits")
    parser.add_argument("--suggest", action="store_true",
                        help="also plan the layouts of this world (tensor 1-8, pipeline 1-8, "
                             "ZeRO 0-3) and list those that fit, fastest first by the predicted "
                             "step time")
    parser.add_argument("--burst", action="store_true",
                        help="also plan DeepPool's burst parallelism: a data-parallel width "
                             "per layer for the global batch on up to --world GPUs, its step "
                             "against every layer on --world, and the GPU-seconds per step "
                             "it frees for a background job")
    parser.add_argument("--amplification", type=float, default=2.0, metavar="A",
                        help="with --burst: the most GPU-time a layer may spend over its most "
                             "economical width (default 2.0)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--device", default="h100", metavar="NAME",
                        help="device to predict the step time on: h100 (default), h200, "
                             "a100, cpu")
    parser.add_argument("--device-file", metavar="FILE",
                        help="your own device (TOML or JSON; see docs/plan.md, or write one "
                             "with --calibrate); replaces --device")
    parser.add_argument("--model-opt", dest="model_options", metavar="KEY=VALUE",
                        action="append", default=[],
                        help="keyword for --model module:function (repeatable; numbers are "
                             "read as numbers)")
    parser.add_argument("--model-plan", metavar="MODULE:NAME",
                        help="the ModelPlan of --model module:function (default: the "
                             "model's own model_plan())")
    parser.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="tokens per sample for --model module:function (default: the "
                             "model's max_seq_len)")
    parser.add_argument("--calibrate", metavar="FILE",
                        help="measure this machine (a matrix product, a copy, a gloo "
                             "all-reduce over 2 local processes) into a device file and exit")
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


def _model_options(items: list[str]) -> dict:
    from bigbatch.errors import ConfigError

    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"--model-opt {item!r}: expected KEY=VALUE")
        for cast in (int, float):
            try:
                out[key] = cast(text)
                break
            except ValueError:
                continue
        else:
            out[key] = {"true": True, "false": False}.get(text.lower(), text)
    return out


def _device(args: argparse.Namespace):
    from bigbatch.planner.devices import device, load_device

    return load_device(args.device_file) if args.device_file else device(args.device)


DEFAULT_MODEL_STRATEGY = """
[optimizer]
type = "adamw"

[amp]
enable = true
dtype = "bfloat16"
"""
"""`--model module:function` without --config: AdamW, bf16 autocast."""


def run_plan_command(args: argparse.Namespace) -> int:
    """`bigbatch plan`; returns the exit code, raises ConfigError on user mistakes."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bigbatch.errors import ConfigError

    if args.calibrate is not None:
        from bigbatch.planner.calibrate import calibrate_to

        print(calibrate_to(Path(args.calibrate)))
        return 0
    if args.world is None:
        raise ConfigError("--world: required (the number of GPUs to plan for)")
    dev = _device(args)
    from bigbatch.planner.planning import plan_task
    from bigbatch.planner.report import render_suggestions, render_time

    if args.amplification < 1 or args.amplification != args.amplification:
        raise ConfigError(f"--amplification {args.amplification:g}: expected a number >= 1 "
                          "(the GPU-time a layer may spend over its most economical width)")
    own = args.model is not None and ":" in args.model
    if own:
        from bigbatch.planner.own_model import plan_model

        options = _model_options(args.model_options)
        strategy = plan_strategy(args, DEFAULT_MODEL_STRATEGY)
        name, model = args.model, args.model

        def plan_one(s, **kw):
            return plan_model(args.model, s, args.world, options=options,
                              seq_len=args.seq_len, plan_spec=args.model_plan,
                              gpu_memory=args.gpu_memory, **kw)
    else:
        for flag, value in (("--model-opt", args.model_options),
                            ("--model-plan", args.model_plan), ("--seq-len", args.seq_len)):
            if value:
                raise ConfigError(f"{flag}: only with --model module:function")
        from bigbatch.tasks import get_task

        task = get_task(args.task, **task_options(args.task_options))
        model = task.check_model(args.model)
        strategy = plan_strategy(args, task.demo_strategy)
        name = task.name

        def plan_one(s, **kw):
            return plan_task(task, s, args.world, model=model, gpu_memory=args.gpu_memory, **kw)

    planned = plan_one(strategy)
    burst = None
    if args.burst:
        burst = _burst(args, strategy, planned, dev, own)
    timed = planned.time(dev) if planned.ranks[0].compute is not None else None
    rows, tried, times = [], 0, None
    if args.suggest:
        from bigbatch.planner.suggest import suggest

        rows, tried = suggest(strategy, args.world, lambda s, probes: plan_one(
            s, probes=probes, ends_only=True), args.gpu_memory,
            seconds=lambda p: p.time(dev).seconds)
        times = [p.time(dev) for p, _ in rows]
    if args.json:
        out = {"task": None if own else name, "model": model, **planned.to_dict()}
        out["time"] = timed.to_dict() if timed is not None else None
        out["device_source"] = dev.source
        if args.suggest:
            out["suggestions"] = [{"set": sets, "mesh": p.mesh, "zero_stage": p.degrees.stage,
                                   "peak": p.worst.peak,
                                   "comm_sent_bytes_per_step": p.to_dict()[
                                       "comm_sent_bytes_per_step"], "bubble": p.bubble,
                                   "time": t.to_dict()}
                                  for (p, sets), t in zip(rows, times, strict=True)]
            out["suggestions_tried"] = tried
        if burst is not None:
            out["burst"] = burst.to_dict()
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    what = f"model {model}" if own else f"task {name} ({model})"
    print(f"bigbatch plan: {what}, {planned.summary()}")
    if timed is not None:
        print()
        print(render_time(timed))
    if args.suggest:
        print()
        print(render_suggestions(rows, args.gpu_memory, tried, times))
    if burst is not None:
        print()
        print(burst.render())
    return 0


def _burst(args: argparse.Namespace, strategy, planned, dev, own: bool):
    """`--burst`: the planner's `plan_burst` on the planned model, for its global batch."""
    from bigbatch.engine.amp import amp_dtype
    from bigbatch.planner.burst import plan_burst

    if own:
        from bigbatch.planner.own_model import model_parts

        model_fn, example, loss, model_plan = model_parts(
            args.model, options=_model_options(args.model_options), seq_len=args.seq_len,
            plan_spec=args.model_plan)
        layers = getattr(model_plan, "pipeline_layers", None)
    else:
        from bigbatch.planner.planning import task_parts
        from bigbatch.tasks import get_task

        task = get_task(args.task, **task_options(args.task_options))
        model_fn, example, loss = task_parts(task, args.model)
        layers = None
    amp = strategy.amp
    return plan_burst(model_fn, example, loss, world=args.world,
                      batch=planned.batch.global_batch_size, dev=dev,
                      limit=args.amplification,
                      amp_dtype=amp_dtype(amp.dtype) if amp.enable else None,
                      pipeline_layers=layers)
