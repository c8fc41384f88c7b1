"""Memory per rank under ZeRO sharding (stages 0-3) and tensor parallelism (degree 2),
at 1, 2 and 4 gloo ranks.

Builds the charlm Transformer (the `--d-model`/`--layers` sizes), trains it with
LAMB through `bigbatch.engine.prepare` under `[sharding] stage = S` and measures,
on each rank, the bytes this rank holds at the optimizer step (the peak of the
three, with gradients and state all alive): parameters, gradients, optimizer
state (local shards of DTensors; ZeRO-1's own partition). Also the step time of
each stage against DDP (stage 0) at the same global batch, in the same run. Row
`tp2` is tensor degree 2 (and data degree N/2) at the same global batch.
Then prints the analytic figure for BERT-large (335 M parameters, fp32 LAMB:
4 + 4 + 8 bytes per parameter) as a reference for what the ratios mean at scale.

    .venv/bin/python benchmarks/memory.py [--worlds 1,2,4] [--d-model 256] [--layers 4]

Target: stage 3 at N ranks <= 1.1/N of stage 0 (parameters + gradients + state).
Stages 2 and 3 hold the same at the optimizer step; they differ between forward and
backward, where stage 2 keeps each block's gathered parameters (1 block at a time
for stage 3). Column `fwd MB` measures that: the largest parameter bytes a rank holds
at any module's forward (the parameters gathered whole at that moment plus the rank's
own shards), over one forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gloo import run_on_workers  # noqa: E402

from bigbatch.config.strategy import Strategy  # noqa: E402
from bigbatch.engine.prepare import prepare  # noqa: E402
from bigbatch.tasks.charlm import TENSOR_PARALLEL_PLAN, CharTransformer  # noqa: E402

VOCAB, SEQ = 96, 64
BERT_LARGE = 335_000_000


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = _local(t)
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's part
    return [v for state in inner.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1]


def _forward_peak(module: torch.nn.Module) -> tuple[list, dict]:
    """Hooks that record the largest parameter bytes held during forward: whole
    (gathered, plain-tensor) parameters at that moment plus this rank's shards."""
    from torch.distributed.tensor import DTensor

    shards = _bytes(p for p in module.parameters() if isinstance(p, DTensor))
    peak = {"fwd": 0}

    def hook(_m, _args):
        whole = _bytes(p for p in module.parameters() if not isinstance(p, DTensor))
        peak["fwd"] = max(peak["fwd"], whole + shards)

    return [m.register_forward_pre_hook(hook) for m in module.modules()], peak


def _strategy(stage: int | str, global_batch: int) -> Strategy:
    d = {"batch": {"global_batch_size": global_batch, "base_batch_size": global_batch,
                   "base_lr": 1e-3},
         "optimizer": {"type": "adamw", "weight_decay": 0.0}, "lamb": {}}
    if stage == "tp2":
        d["tensor_parallel"] = {"tensor_parallel_degree": 2}
    elif stage:
        d["sharding"] = {"stage": stage}
    return Strategy.from_dict(d)


def measure(rank: int, args) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = {}
    for stage in args.stages:
        data = world // 2 if stage == "tp2" else world
        micro = args.global_batch // data
        g = torch.Generator().manual_seed(rank // (world // data))  # tensor peers: one batch
        x = torch.randint(0, VOCAB, (args.steps, micro, SEQ), generator=g)
        torch.manual_seed(0)
        model = CharTransformer(VOCAB, SEQ, d_model=args.d_model, n_layer=args.layers,
                                n_head=args.d_model // 64 or 1)
        run = prepare(model, _strategy(stage, args.global_batch), total_steps=args.steps,
                      tp_plan=TENSOR_PARALLEL_PLAN if stage == "tp2" else None)
        held = {}

        def at_step(opt, a, kw, run=run, held=held):
            params = list(run.module.parameters())
            held.update(params=_bytes(params),
                        grads=_bytes(p.grad for p in params if p.grad is not None),
                        state=_bytes(_optimizer_tensors(run.optimizer)))

        run.optimizer.register_step_pre_hook(at_step)
        times, hooks, peak = [], [], {"fwd": 0}
        for step in range(args.steps):
            if step == 1:  # after the first step: shards, state and buffers in place
                hooks, peak = _forward_peak(run.module)
            t0 = time.perf_counter()
            with run.micro_step() as ms:
                logits = run.model(x[step])
                ms.backward(F.cross_entropy(logits.flatten(0, 1).float(), x[step].flatten()))
            times.append(time.perf_counter() - t0)
            for h in hooks:
                h.remove()
            hooks = []
        rows[stage] = {**held, "fwd": peak["fwd"], "step_s": statistics.median(times[2:])}
        del run, model
    path = Path(args.out) / f"w{world}_r{rank}.json"
    path.write_text(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    args.stages = [0, 1, 2, 3, "tp2"]
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory() as out:
        args.out = out
        for w in worlds:
            if w == 1:
                torch.set_num_threads(args.threads)
                args.stages = [0]  # one rank: nothing to shard
                measure(0, args)
                args.stages = [0, 1, 2, 3, "tp2"]
            else:
                run_on_workers(measure, args, world=w)
        results = {w: [json.loads((Path(out) / f"w{w}_r{r}.json").read_text()) for r in range(w)]
                   for w in worlds}
    n_params = sum(p.numel() for p in CharTransformer(
        VOCAB, SEQ, d_model=args.d_model, n_layer=args.layers,
        n_head=args.d_model // 64 or 1).parameters())
    print(f"charlm Transformer d_model={args.d_model} layers={args.layers}: {n_params / 1e6:.2f} M "
          f"parameters, fp32 LAMB; bytes per rank (max over ranks) at the optimizer step")
    base = max(r["0"]["params"] + r["0"]["grads"] + r["0"]["state"] for r in results[worlds[0]])
    print(f"{'ranks':>5} {'mode':>5} {'params MB':>10} {'grads MB':>9} {'state MB':>9} "
          f"{'total MB':>9} {'x stage0@1':>10} {'x 1/N':>6} {'fwd MB':>7} {'step ms':>8} "
          f"{'x DDP':>6}")
    for w in worlds:
        ddp_time = statistics.median(r["0"]["step_s"] for r in results[w])
        for stage in results[w][0]:
            rows = [r[stage] for r in results[w]]
            worst = max(rows, key=lambda r: r["params"] + r["grads"] + r["state"])
            total = worst["params"] + worst["grads"] + worst["state"]
            step = statistics.median(r["step_s"] for r in rows)
            fwd = max(r["fwd"] for r in rows)
            print(f"{w:>5} {stage:>5} {worst['params'] / 1e6:>10.2f} {worst['grads'] / 1e6:>9.2f} "
                  f"{worst['state'] / 1e6:>9.2f} {total / 1e6:>9.2f} {total / base:>10.3f} "
                  f"{total / base * w:>6.2f} {fwd / 1e6:>7.2f} {step * 1e3:>8.1f} "
                  f"{step / ddp_time:>6.2f}")
    print("\nBERT-large, analytic (335 M parameters, fp32 LAMB: params 4 + grads 4 + state 8 B):")
    print(f"{'ranks':>5} " + " ".join(f"{'stage ' + str(s) + ' GB':>11}" for s in range(4)))
    for n in (1, 2, 4, 8, 64):
        per = [4 + 4 + 8, 4 + 4 + 8 / n, 4 + (4 + 8) / n, 16 / n]
        print(f"{n:>5} " + " ".join(f"{BERT_LARGE * b / 1e9:>11.2f}" for b in per))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
