"""Time one optimizer step of LARS / LAMB against torch's own optimizers.

Parameter sets shaped like ResNet-50 (161 tensors, 25.6 M parameters) and
BERT-base (~110 M parameters), fp32, random gradients. Baselines are measured
in the same run, interleaved round by round so machine noise hits all of them
alike: torch AdamW and SGD(momentum=0.9) in each mode this machine offers
(fused, foreach, for-loop), and torch_optimizer.Lamb when installed.

    python benchmarks/optim_step.py [--model resnet50|bert|both] [--rounds 15]

Prints the median milliseconds per step and ratios: LAMB against AdamW and
LARS against SGD, each against the fastest mode of the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bigbatch.optim import LAMB, LARS


def resnet50_shapes() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    width_in = 64
    for mid, out, blocks in [(64, 256, 3), (128, 512, 4), (256, 1024, 6), (512, 2048, 3)]:
        for b in range(blocks):
            shapes += [(mid, width_in, 1, 1), (mid,), (mid,), (mid, mid, 3, 3), (mid,), (mid,),
                       (out, mid, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, width_in, 1, 1), (out,), (out,)]
            width_in = out
    return shapes + [(1000, 2048), (1000,)]


def bert_base_shapes() -> list[tuple[int, ...]]:
    h, ff = 768, 3072
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


def make_params(shapes, seed=0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02)
        p.grad = torch.randn(s, generator=gen) * 1e-3
        params.append(p)
    return params


def candidates(shapes):
    """(label, family, factory) for every optimizer timed."""
    def mk(factory):
        return lambda: factory(make_params(shapes))

    out = []
    for mode in ("fused", "foreach", "for-loop"):
        kw = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "for-loop": {"foreach": False}}[mode]
        out.append((f"torch AdamW ({mode})", "adamw",
                    mk(lambda p, kw=kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw))))
        out.append((f"torch SGD m=0.9 ({mode})", "sgd",
                    mk(lambda p, kw=kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, **kw))))
    out.append(("bigbatch LAMB", "lamb", mk(lambda p: LAMB(p, lr=1e-3))))
    out.append(("bigbatch LAMB (reference)", "lamb-ref", mk(lambda p: LAMB(p, lr=1e-3, fast=False))))
    out.append(("bigbatch LARS", "lars", mk(lambda p: LARS(p, lr=0.1))))
    out.append(("bigbatch LARS (reference)", "lars-ref", mk(lambda p: LARS(p, lr=0.1, fast=False))))
    try:
        import torch_optimizer
        out.append(("torch_optimizer.Lamb", "lamb-other",
                    mk(lambda p: torch_optimizer.Lamb(p, lr=1e-3, weight_decay=0.01))))
    except ImportError:
        pass
    return out


def bench(shapes, rounds: int) -> dict[str, tuple[str, float]]:
    opts = []
    for label, family, factory in candidates(shapes):
        try:
            opt = factory()
            opt.step()
            opt.step()
        except (RuntimeError, TypeError) as exc:  # a mode this build lacks
            print(f"  skip {label}: {exc}".splitlines()[0])
            continue
        opts.append((label, family, opt))
    times: dict[str, list[float]] = {label: [] for label, _, _ in opts}
    for _ in range(rounds):
        for label, _, opt in opts:
            t0 = time.perf_counter()
            opt.step()
            times[label].append(time.perf_counter() - t0)
    return {label: (family, statistics.median(times[label]) * 1e3) for label, family, _ in opts}


def report(name: str, shapes, rounds: int) -> None:
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"\n{name}: {len(shapes)} tensors, {numel / 1e6:.1f} M fp32 parameters, "
          f"{torch.get_num_threads()} threads, median of {rounds} steps")
    res = bench(shapes, rounds)
    best = {}
    for fam in ("adamw", "sgd"):
        entries = [(ms, label) for label, (f, ms) in res.items() if f == fam]
        best[fam] = min(entries) if entries else None
    for label, (_, ms) in res.items():
        print(f"  {label:30s} {ms:8.1f} ms")
    print("  ratios (lower is better):")
    for fam, base in (("lamb", "adamw"), ("lamb-ref", "adamw"), ("lamb-other", "adamw"),
                      ("lars", "sgd"), ("lars-ref", "sgd")):
        for label, (f, ms) in res.items():
            if f != fam or best[base] is None:
                continue
            fastest_ms, fastest_label = best[base]
            foreach = res.get(f"torch {'AdamW' if base == 'adamw' else 'SGD m=0.9'} (foreach)")
            extra = f", {ms / foreach[1]:.2f}x foreach" if foreach else ""
            print(f"  {label:30s} {ms / fastest_ms:5.2f}x {fastest_label}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["resnet50", "bert", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if args.model in ("resnet50", "both"):
        report("ResNet-50-shaped", resnet50_shapes(), args.rounds)
    if args.model in ("bert", "both"):
        report("BERT-base-shaped", bert_base_shapes(), args.rounds)


if __name__ == "__main__":
    main()
