"""A GPT-2-small-shaped bf16 training loop on one GPU: a plain torch loop against
``bigbatch.prepare`` with AdamW and with LAMB, and host syncs per step.

    python benchmarks/engine_gpu.py [--steps 10] [--rounds 3] [--micro 16] [--k 4]
                                    [--amp float16]

``--amp float16``: fp16 autocast with dynamic loss scaling instead (the plain loop
with torch's ``GradScaler``, bigbatch with ``[amp] dtype = "float16"``).

Model: examples/gpt's GPT at GPT-2 small's shape (12 layers, 12 heads, 768 wide,
vocabulary 50304, 512 positions, 124 M parameters, tied embedding), bf16
autocast, ``k`` micro-batches of ``micro`` sequences merged per step (default
4 x 16 x 512 tokens), gradients clipped to norm 1. The three loops:

- plain: nanoGPT's loop, torch's fused AdamW, ``loss / k`` per micro-step,
  ``clip_grad_norm_``, ``zero_grad(set_to_none=True)``;
- prepare + AdamW: the same recipe as a bigbatch Strategy (``run.micro_step()``);
- prepare + LAMB: the Strategy with ``[lamb]`` (the optimizer's default kernel:
  Triton on CUDA when it imports).

Each is timed over ``steps`` optimizer steps between two synchronisations, in
``rounds`` rounds interleaved so that clock and thermal drift hit all alike;
medians and ratios are printed. Host syncs: one more step each under
``torch.cuda.set_sync_debug_mode("warn")``, counting the warnings it raises.
Only the public API (``bigbatch.prepare``, ``Run.micro_step``) is used.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bigbatch  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

SHAPE = GPTConfig(vocab_size=50304, block_size=512, n_layer=12, n_head=12, n_embd=768)

STRATEGY = """
[batch]
global_batch_size = {batch}
micro_batch_size = {micro}
base_batch_size = {batch}
base_lr = {lr}
scaling = "none"
warmup_steps = 0

[optimizer]
type = "adamw"
beta1 = 0.9
beta2 = 0.95
epsilon = 1e-8
weight_decay = {weight_decay}
max_grad_norm = 1.0

[amp]
dtype = "{amp}"

[gradient_merge]
avg = true
"""


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(SHAPE).cuda()


class Plain:
    """nanoGPT's loop: fused AdamW, bf16 autocast, loss / k, clip, zero_grad(None)."""

    name = "plain torch loop (fused AdamW)"

    def __init__(self, k: int, amp: str) -> None:
        self.net = model()
        decay = [p for p in self.net.parameters() if p.ndim >= 2]
        rest = [p for p in self.net.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
        self.k = k
        self.dtype = getattr(torch, amp)
        self.scaler = torch.amp.GradScaler("cuda") if amp == "float16" else None

    def step(self, batch) -> None:
        for x, y in batch:
            with torch.autocast("cuda", dtype=self.dtype):
                logits = self.net(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / self.k
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


class Prepared:
    """The same recipe through ``bigbatch.prepare``: AdamW, or LAMB with ``lamb``."""

    def __init__(self, micro: int, k: int, lamb: bool, total_steps: int, amp: str) -> None:
        text = STRATEGY.format(batch=micro * k, micro=micro, lr=2e-3 if lamb else 6e-4,
                               weight_decay=0.0 if lamb else 0.1, amp=amp)
        if lamb:
            text += "\n[lamb]\nlamb_weight_decay = 0.1\n"
        self.name = f"bigbatch.prepare + {'LAMB' if lamb else 'AdamW'}"
        self.run = bigbatch.prepare(model(), bigbatch.Strategy.from_toml(text),
                                    total_steps=total_steps)
        self.name += f" ({type(self.run.optimizer).__name__})"

    def step(self, batch) -> None:
        for x, y in batch:
            with self.run.micro_step() as ms:
                logits = self.run.model(x)
                ms.backward(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))


def batches(micro: int, k: int, count: int):
    """Random token batches made on the device beforehand: no data loading in the loop."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(count):
        x = torch.randint(0, SHAPE.vocab_size, (k, micro, SHAPE.block_size), device="cuda",
                          generator=g)
        out.append(list(zip(x, x.roll(-1, dims=2), strict=True)))
    return out


def timed(loop, data) -> float:
    """Milliseconds per step over ``data``, between two synchronisations."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for batch in data:
        loop.step(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(data) * 1e3


def host_syncs(loop, batch) -> int:
    """Synchronising CUDA calls in one step, as ``set_sync_debug_mode("warn")`` sees them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loop.step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro", type=int, default=16, help="sequences per micro-batch")
    ap.add_argument("--k", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--amp", choices=("bfloat16", "float16"), default="bfloat16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    total = (args.steps * args.rounds + 4) * 2
    loops = [Plain(args.k, args.amp), Prepared(args.micro, args.k, False, total, args.amp),
             Prepared(args.micro, args.k, True, total, args.amp)]
    data = batches(args.micro, args.k, args.steps)
    for loop in loops:  # warm up: autotuning, Triton compilation, allocator
        timed(loop, data[:2])
    times: dict[str, list[float]] = {loop.name: [] for loop in loops}
    for _ in range(args.rounds):
        for loop in loops:
            times[loop.name].append(timed(loop, data))
    syncs = {loop.name: host_syncs(loop, data[0]) for loop in loops}
    print(f"{torch.cuda.get_device_name()}, torch {torch.version.__version__}; GPT-2 small "
          f"shape, {args.amp}, {args.k} x {args.micro} x {SHAPE.block_size} tokens per step; "
          f"median of {args.rounds} rounds of {args.steps} steps")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base, adamw, lamb = (med[loop.name] for loop in loops)
    for loop in loops:
        print(f"  {loop.name:45s} {med[loop.name]:8.2f} ms/step   host syncs/step: "
              f"{syncs[loop.name]}")
    print(f"  prepare + AdamW / plain loop      {adamw / base:6.3f}x  (target <= 1.01)")
    print(f"  prepare + LAMB / prepare + AdamW  {lamb / adamw:6.3f}x  (target <= 1.02)")


if __name__ == "__main__":
    main()
