"""Time one optimizer step of LARS / LAMB against torch's own optimizers.

Parameter sets shaped like ResNet-50 (161 tensors, 25.6 M parameters),
BERT-base (~110 M) and BERT-large (~335 M), fp32, random gradients. Baselines
are measured in the same run, interleaved round by round so machine noise hits
all of them alike: torch AdamW and SGD(momentum=0.9) in each mode this machine
offers (fused, foreach, for-loop), and torch_optimizer.Lamb when installed.
LARS and LAMB run in each kernel mode (per_tensor, multi_tensor, reference).

    python benchmarks/optim_step.py [--model resnet50|bert|bert-large|both]
        [--device cpu|cuda] [--rounds 15] [--threads N] [--sharded N]

Prints the median milliseconds per step and ratios: LAMB against AdamW and
LARS against SGD, each against the fastest mode of the baseline. On CUDA each
step is timed between ``torch.cuda.synchronize()`` calls.
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


def bert_large_shapes() -> list[tuple[int, ...]]:
    h, ff = 1024, 4096
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(24):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


def make_params(shapes, device="cpu", seed=0, mesh=None) -> list[torch.nn.Parameter]:
    """Random weights and gradients; with ``mesh``, DTensors sharded on dim 0 as
    FSDP2's ``fully_shard`` lays them out."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        w = torch.randn(s, generator=gen, device=device) * 0.02
        g = torch.randn(s, generator=gen, device=device) * 1e-3
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor
            w, g = (distribute_tensor(t, mesh, [Shard(0)]) for t in (w, g))
        p = torch.nn.Parameter(w)
        p.grad = g
        params.append(p)
    return params


def candidates(shapes, device, mesh=None):
    """(label, family, factory) for every optimizer timed (sharded: the fast modes)."""
    def mk(factory):
        return lambda: factory(make_params(shapes, device, mesh=mesh))

    out = []
    for mode in ("fused", "foreach") + (() if mesh is not None else ("for-loop",)):
        kw = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "for-loop": {"foreach": False}}[mode]
        out.append((f"torch AdamW ({mode})", "adamw",
                    mk(lambda p, kw=kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw))))
        out.append((f"torch SGD m=0.9 ({mode})", "sgd",
                    mk(lambda p, kw=kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, **kw))))
    kernels = ("per_tensor", "multi_tensor") + (() if mesh is not None else ("reference",))
    if device == "cuda":
        kernels = ("triton",) + kernels
    for kernel in kernels:
        fam = "" if kernel != "reference" else "-ref"
        out.append((f"bigbatch LAMB ({kernel})", "lamb" + fam,
                    mk(lambda p, k=kernel: LAMB(p, lr=1e-3, kernel=k))))
        out.append((f"bigbatch LARS ({kernel})", "lars" + fam,
                    mk(lambda p, k=kernel: LARS(p, lr=0.1, kernel=k))))
    try:
        from timm.optim import Lamb as TimmLamb
        from timm.optim import Lars as TimmLars

        out.append(("timm Lamb", "lamb-other",
                    mk(lambda p: TimmLamb(p, lr=1e-3, weight_decay=0.01))))
        out.append(("timm Lars", "lars-other", mk(lambda p: TimmLars(p, lr=0.1, momentum=0.9))))
    except ImportError:
        pass
    try:
        import torch_optimizer
        out.append(("torch_optimizer.Lamb", "lamb-other",
                    mk(lambda p: torch_optimizer.Lamb(p, lr=1e-3, weight_decay=0.01))))
    except ImportError:
        pass
    return out


def bench(shapes, rounds: int, device: str, mesh=None) -> dict[str, tuple[str, float]]:
    if mesh is not None:  # every rank starts each step together
        sync = torch.distributed.barrier
    else:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opts = []
    for label, family, factory in candidates(shapes, device, mesh):
        try:
            opt = factory()
            opt.step()
            opt.step()
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # a mode it lacks
            say(f"  skip {label}: {exc}".splitlines()[0])
            continue
        opts.append((label, family, opt))
    times: dict[str, list[float]] = {label: [] for label, _, _ in opts}
    for _ in range(rounds):
        for label, _, opt in opts:
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times[label].append(time.perf_counter() - t0)
    return {label: (family, statistics.median(times[label]) * 1e3) for label, family, _ in opts}


def say(line: str) -> None:
    """Print once: on rank 0 when sharded over workers."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def report(name: str, shapes, rounds: int, device: str, mesh=None) -> None:
    numel = sum(torch.Size(s).numel() for s in shapes)
    where = torch.cuda.get_device_name() if device == "cuda" else \
        f"{torch.get_num_threads()} threads"
    if mesh is not None:
        where = f"sharded on dim 0 over {mesh.size()} gloo workers of {where}"
    say(f"\n{name}: {len(shapes)} tensors, {numel / 1e6:.1f} M fp32 parameters, "
        f"{where}, median of {rounds} steps")
    res = bench(shapes, rounds, device, mesh)
    best = {}
    for fam in ("adamw", "sgd"):
        entries = [(ms, label) for label, (f, ms) in res.items() if f == fam]
        best[fam] = min(entries) if entries else None
    for label, (_, ms) in res.items():
        say(f"  {label:30s} {ms:8.1f} ms")
    say("  ratios (lower is better):")
    for fam, base in (("lamb", "adamw"), ("lamb-ref", "adamw"), ("lamb-other", "adamw"),
                      ("lars", "sgd"), ("lars-ref", "sgd"), ("lars-other", "sgd")):
        for label, (f, ms) in res.items():
            if f != fam or best[base] is None:
                continue
            fastest_ms, fastest_label = best[base]
            foreach = res.get(f"torch {'AdamW' if base == 'adamw' else 'SGD m=0.9'} (foreach)")
            extra = f", {ms / foreach[1]:.2f}x foreach" if foreach else ""
            say(f"  {label:30s} {ms / fastest_ms:5.2f}x {fastest_label}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["resnet50", "bert", "bert-large", "both"],
                    default="both")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (default: torch's). With 1 thread memory bandwidth "
                         "stops being the limit, and the ratios show the extra compute")
    ap.add_argument("--sharded", type=int, default=0, metavar="N",
                    help="parameters as DTensors sharded over N gloo workers on this "
                         "machine, as FSDP2 lays them out (CPU; 1 thread each by default)")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 0 or args.sharded < 0 or args.sharded == 1:
        ap.error("--rounds must be >= 1, --threads >= 0 and --sharded 0 or >= 2")
    if args.sharded and args.device != "cpu":
        ap.error("--sharded runs gloo workers: use --device cpu")
    if args.sharded:
        from _gloo import run_on_workers
        args.threads = args.threads or 1
        run_on_workers(measure, args, world=args.sharded)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    measure(0, args)


def measure(rank: int, args) -> None:
    """Every report this command asks for (on each worker when sharded)."""
    mesh = None
    if args.sharded:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (args.sharded,))
    if args.model in ("resnet50", "both"):
        report("ResNet-50-shaped", resnet50_shapes(), args.rounds, args.device, mesh)
    if args.model in ("bert", "both"):
        report("BERT-base-shaped", bert_base_shapes(), args.rounds, args.device, mesh)
    if args.model == "bert-large":
        report("BERT-large-shaped", bert_large_shapes(), args.rounds, args.device, mesh)


if __name__ == "__main__":
    main()
