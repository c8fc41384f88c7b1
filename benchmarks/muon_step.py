"""Time one step of `bigbatch.Muon` against plain single-process Muon at the same shapes.

Parameter sets shaped like a GPT-2 (token and position embeddings, per block the fused
QKV, the attention output, the MLP's two matrices, two LayerNorms and biases, an untied
head): ``--model mini`` (d 256, 4 blocks, vocabulary 8192: CPU-sized) or ``small``
(GPT-2 small: d 768, 12 blocks, vocabulary 50257). Random float32 gradients. Measured in
the same run, interleaved round by round:

- ``plain``: the published algorithm as one writes it in a single process: a loop over
  the matrices (momentum, Nesterov, 5 Newton-Schulz steps, Moonlight's scale, decoupled
  weight decay) and torch's fused AdamW for the rest;
- ``torch``: ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``) + fused AdamW, when
  this torch has it;
- ``bigbatch``: `bigbatch.Muon` with its batched kernel (``--kernel reference`` too);
- on CUDA also ``fused AdamW`` over every tensor: what the Muon step adds over AdamW.

    python benchmarks/muon_step.py [--model mini|small] [--device cpu|cuda] [--rounds 7]
        [--threads N] [--train-tokens 524288 --micro 16]

Prints the median milliseconds per step and bigbatch's ratio to the plain loop. On CUDA
each step is timed by CUDA events and runs in bfloat16 Newton-Schulz (bigbatch's default
there) with ``torch.cuda.set_sync_debug_mode("error")``: a host sync inside the step raises.

``--train-tokens N`` also times the forward and backward of the same GPT-2 (untied head,
sequence 1024, bf16 autocast on CUDA) over ``--micro`` sequences and scales it to a step
of N tokens (Moonlight's 0.5M: 524288), then prints what the Muon step adds to that
training step over fused AdamW's (issue 42's target: <= 3% on GPT-2 small).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from bigbatch.optim import Muon
from bigbatch.optim.muon import newton_schulz


def gpt2_shapes(d: int, layers: int, vocab: int, seq: int = 1024
                ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(Muon's matrices, AdamW's tensors) of a GPT-2 of this size."""
    matrices, rest = [], [(vocab, d), (seq, d), (vocab, d), (d,), (d,)]
    for _ in range(layers):
        matrices += [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
        rest += [(3 * d,), (d,), (4 * d,), (d,), (d,), (d,), (d,), (d,)]
    return matrices, rest


MODELS = {"mini": (256, 4, 8192), "small": (768, 12, 50257)}


def make(shapes, device, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device) * 1e-3
    return params


class PlainMuon:
    """The single-process loop, as the write-ups give it, plus fused AdamW for the rest."""

    def __init__(self, matrices, rest, lr=1e-3, momentum=0.95, wd=0.1, ns_dtype=None):
        self.matrices, self.lr, self.momentum, self.wd = matrices, lr, momentum, wd
        self.bufs = [torch.zeros_like(p) for p in matrices]
        self.adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=wd, fused=True)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self):
        for p, b in zip(self.matrices, self.bufs, strict=True):
            b.mul_(self.momentum).add_(p.grad)
            o = newton_schulz(p.grad.add(b, alpha=self.momentum), dtype=self.ns_dtype)
            p.mul_(1 - self.lr * self.wd)
            p.add_(o, alpha=-self.lr * 0.2 * math.sqrt(max(p.shape)))
        self.adamw.step()


def candidates(args, device):
    matrices, rest = gpt2_shapes(*MODELS[args.model])
    ns_dtype = torch.bfloat16 if device == "cuda" else None
    out = {}
    m, r = make(matrices, device, 0), make(rest, device, 1)
    out["plain"] = PlainMuon(m, r, ns_dtype=ns_dtype)
    if hasattr(torch.optim, "Muon"):
        m, r = make(matrices, device, 0), make(rest, device, 1)
        tm = torch.optim.Muon(m, lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        ta = torch.optim.AdamW(r, lr=1e-3, weight_decay=0.1, fused=True)
        out["torch"] = type("TorchMuon", (), {"step": lambda self: (tm.step(), ta.step())})()
    for kernel in ("batched", "reference"):
        m, r = make(matrices, device, 0), make(rest, device, 1)
        out[f"bigbatch {kernel}"] = Muon([{"params": m, "use_muon": True},
                                          {"params": r, "use_muon": False}],
                                         lr=1e-3, kernel=kernel)
    if device == "cuda":
        out["fused AdamW (all)"] = torch.optim.AdamW(make(matrices + rest, device, 0), lr=1e-3,
                                                     fused=True)
    return out, sum(math.prod(s) for s in matrices + rest)


def time_step(opt, device) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            start.record()
            opt.step()
            end.record()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    opt.step()
    return (time.perf_counter() - t0) * 1e3


def forward_backward_ms(args, device: str) -> float:
    """Median ms of one micro-batch's forward and backward of the GPT-2 of `args.model`."""
    from bigbatch.tasks.charlm import CharTransformer

    d, layers, vocab = MODELS[args.model]
    torch.manual_seed(0)
    net = CharTransformer(vocab, 1024, d, layers, d // 64, tie_weights=False).to(device)
    x = torch.randint(0, vocab, (args.micro, 1024), device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    times = []
    for i in range(3 + args.rounds):
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
            logits = net(x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="mini")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--train-tokens", type=int, default=0,
                    help="also time a training step of this many tokens (0: off)")
    ap.add_argument("--micro", type=int, default=16, help="sequences per micro-batch")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    opts, numel = candidates(args, args.device)
    times: dict[str, list[float]] = {name: [] for name in opts}
    for opt in opts.values():  # warm-up: state creation, kernels' first calls
        opt.step()
    for _ in range(args.rounds):
        for name, opt in opts.items():
            times[name].append(time_step(opt, args.device))
    print(f"Muon step, GPT-2 {args.model} shapes ({numel / 1e6:.1f} M parameters), "
          f"{args.device}, {torch.get_num_threads()} threads, median of {args.rounds}")
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name:20s} {ms:9.2f} ms   x{ms / base:.2f} of plain")
    if args.train_tokens:
        del opts
        micro_ms = forward_backward_ms(args, args.device)
        micros = args.train_tokens / (args.micro * 1024)
        fwd_bwd = micro_ms * micros
        muon = statistics.median(times["bigbatch batched"])
        ref = "fused AdamW (all)" if "fused AdamW (all)" in times else "plain"
        adamw = statistics.median(times[ref])
        print(f"training step of {args.train_tokens} tokens: forward+backward {fwd_bwd:.1f} ms "
              f"({micros:g} micro-batches of {args.micro} x 1024 at {micro_ms:.2f} ms)")
        print(f"  Muon step {muon:.2f} ms = {100 * muon / (fwd_bwd + muon):.2f}% of the step; "
              f"adds {100 * (muon - adamw) / (fwd_bwd + adamw):.2f}% over {ref} "
              f"({adamw:.2f} ms)")


if __name__ == "__main__":
    main()
