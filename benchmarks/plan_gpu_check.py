"""The plan's memory against one real GPU: `bigbatch.plan` at world 1 (meta device)
beside `prepare()`'s run of the same charlm Transformer on CUDA, fp32 and bf16 autocast.

Measured on the GPU (torch.cuda.memory_allocated): the state before the first forward
(parameters), after forward minus before (activations; under autocast this includes the
bf16 weight copies autocast caches for the forward), and the peak of a step
(max_memory_allocated) with gradients and LAMB state alive.

    python3 benchmarks/plan_gpu_check.py [--out DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bigbatch import Strategy, plan, prepare
from bigbatch.parallel.world import World
from bigbatch.tasks.charlm import CharTransformer

VOCAB, SEQ, D, LAYERS, HEADS, MICRO = 96, 512, 1024, 8, 16, 8


def _model() -> CharTransformer:
    return CharTransformer(VOCAB, SEQ, d_model=D, n_layer=LAYERS, n_head=HEADS)


def _strategy(amp: bool) -> Strategy:
    d = {"batch": {"micro_batch_size": MICRO}, "optimizer": {"type": "adamw"}, "lamb": {}}
    if amp:
        d["amp"] = {"dtype": "bfloat16"}
    return Strategy.from_dict(d)


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten(), reduction="sum")


def measure(amp: bool, device: str) -> dict:
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # An earlier measurement's run may still hold memory (reference cycles): free what can
    # be freed and count from what is left.
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    allocated = (lambda: torch.cuda.memory_allocated() - base) if device == "cuda" else (
        lambda: 0)
    run = prepare(_model(), _strategy(amp), total_steps=10,
                  world=World(device=torch.device(device)))
    x = torch.randint(0, VOCAB, (MICRO, SEQ), device=device)
    out = {}
    for step in range(3):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        before = allocated()
        with run.micro_step() as ms:
            logits = run.model(x)
            sync()
            after_forward = allocated()
            ms.backward(_loss(logits, x), count=x.numel())
        sync()
        if step == 2:
            out = {"state_before_forward": before,
                   "activations_measured": after_forward - before,
                   "peak_measured": torch.cuda.max_memory_allocated() - base
                   if device == "cuda" else 0, "held_before": base}
    p = plan(_model, _strategy(amp), 1, loss=_loss,
             example=lambda b: (torch.zeros(b, SEQ, dtype=torch.long),) * 2)
    r = p.ranks[0]
    out.update(params=r.params, grads=r.grads, optimizer=r.optimizer,
               activations_planned=r.activations, peak_planned=r.peak)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/plan_gpu_check"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model (a CPU smoke run)")
    args = parser.parse_args()
    if args.small:
        global SEQ, D, LAYERS, MICRO
        SEQ, D, LAYERS, MICRO = 32, 64, 2, 2
    rows = {name: measure(amp, args.device) for name, amp in (("fp32", False), ("bf16", True))}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "plan_gpu.json").write_text(json.dumps(rows, indent=1))
    gib = 2**30
    print(f"charlm d_model {D}, {LAYERS} layers, seq {SEQ}, micro {MICRO}, LAMB; GiB")
    print(f"{'':>5} {'act plan':>9} {'act GPU':>9} {'ratio':>6} {'peak plan':>10} "
          f"{'peak GPU':>9} {'ratio':>6} {'state':>7}")
    for name, r in rows.items():
        print(f"{name:>5} {r['activations_planned'] / gib:>9.3f} "
              f"{r['activations_measured'] / gib:>9.3f} "
              f"{r['activations_planned'] / max(r['activations_measured'], 1):>6.2f} "
              f"{r['peak_planned'] / gib:>10.3f} {r['peak_measured'] / gib:>9.3f} "
              f"{r['peak_planned'] / max(r['peak_measured'], 1):>6.2f} "
              f"{(r['params'] + r['grads'] + r['optimizer']) / gib:>7.3f}")


if __name__ == "__main__":
    main()
