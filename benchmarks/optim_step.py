"""Time one optimizer step of LARS / LAMB against torch's own optimizers.

Parameter sets shaped like ResNet-50 (161 tensors, 25.6 M parameters),
BERT-base (~110 M) and BERT-large (~335 M, 391 tensors), fp32, random
gradients. Baselines are measured in the same run, interleaved round by round
so machine noise hits all of them alike: torch AdamW and SGD(momentum=0.9) in
each mode this machine offers (fused, foreach, for-loop), and timm's
Lamb/Lars and torch_optimizer.Lamb when installed. LARS and LAMB run in each
kernel mode: per_tensor, multi_tensor and reference on CPU; triton and
multi_tensor on CUDA.

    python benchmarks/optim_step.py [--model resnet50|bert|bert-large|both]
        [--device cpu|cuda] [--rounds 15] [--threads N] [--sharded N]
        [--triton-config CHUNK,BLOCK,WARPS ...]

Prints the median milliseconds per step and ratios: LAMB against AdamW and
LARS against SGD, each against the fastest mode of the baseline. On CUDA each
step runs alone (synchronised before and after) and is timed by CUDA events
around it; the bytes floor of each family (the bytes it must move per
parameter, at the bandwidth of a measured device-to-device copy) is printed
with each result's multiple of it. ``--triton-config`` adds the Triton kernel
at other chunk sizes, block sizes and warp counts (for tuning).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bigbatch.optim import LAMB, LARS, _triton_plan


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


class Configured:
    """An optimizer whose steps run with some ``_triton_plan`` settings in force."""

    def __init__(self, opt, settings: dict) -> None:
        self.opt, self.settings = opt, settings

    def step(self) -> None:
        saved = {k: getattr(_triton_plan, k) for k in self.settings}
        for k, v in self.settings.items():
            setattr(_triton_plan, k, v)
        try:
            self.opt.step()
        finally:
            for k, v in saved.items():
                setattr(_triton_plan, k, v)


def candidates(shapes, device, mesh=None, triton_configs=()):
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
    if device == "cuda":  # per_tensor and reference are CPU kernels (they read to the host)
        kernels = ("triton", "multi_tensor")
    for kernel in kernels:
        fam = "" if kernel != "reference" else "-ref"
        out.append((f"bigbatch LAMB ({kernel})", "lamb" + fam,
                    mk(lambda p, k=kernel: LAMB(p, lr=1e-3, kernel=k))))
        out.append((f"bigbatch LARS ({kernel})", "lars" + fam,
                    mk(lambda p, k=kernel: LARS(p, lr=0.1, kernel=k))))
    for chunk, block, warps in triton_configs:
        settings = dict(CHUNK=chunk, BLOCK=block, NUM_WARPS=warps)
        tag = f"triton {chunk // 1024}K/{block}/{warps}w"
        out.append((f"bigbatch LAMB ({tag})", "lamb",
                    mk(lambda p, s=settings: Configured(LAMB(p, lr=1e-3, kernel="triton"), s))))
        out.append((f"bigbatch LARS ({tag})", "lars",
                    mk(lambda p, s=settings: Configured(LARS(p, lr=0.1, kernel="triton"), s))))
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


def bench(shapes, rounds: int, device: str, mesh=None,
          triton_configs=()) -> dict[str, tuple[str, float]]:
    if mesh is not None:  # every rank starts each step together
        sync = torch.distributed.barrier
    else:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opts = []
    for label, family, factory in candidates(shapes, device, mesh, triton_configs):
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
            if device == "cuda" and mesh is None:
                times[label].append(_cuda_seconds(opt.step))
                continue
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times[label].append(time.perf_counter() - t0)
    return {label: (family, statistics.median(times[label]) * 1e3) for label, family, _ in opts}


def _cuda_seconds(fn) -> float:
    """``fn()`` alone on the device (nothing queued before, waited for after), timed by
    CUDA events around it: the device time, host launch gaps included."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# Bytes a step must move per fp32 parameter (reads and writes of weight, gradient and
# state): AdamW reads w, g, m, v and writes w, m, v; momentum SGD reads w, g, b and writes
# w, b. LAMB in two passes over memory reads w, g, m, v and writes m, v, then reads m, v, w
# and writes w (or writes u and reads it back: the same); LARS reads w, g for the norms,
# then w, g, b and writes w, b.
FLOOR_BYTES = {"adamw": 28, "sgd": 20, "lamb": 40, "lars": 28}


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), median of 10."""
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(_cuda_seconds(lambda: dst.copy_(src)) for _ in range(10))
    return 2 * nbytes / seconds


def say(line: str) -> None:
    """Print once: on rank 0 when sharded over workers."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def report(name: str, shapes, rounds: int, device: str, mesh=None, triton_configs=()) -> None:
    numel = sum(torch.Size(s).numel() for s in shapes)
    where = torch.cuda.get_device_name() if device == "cuda" else \
        f"{torch.get_num_threads()} threads"
    if mesh is not None:
        where = f"sharded on dim 0 over {mesh.size()} gloo workers of {where}"
    say(f"\n{name}: {len(shapes)} tensors, {numel / 1e6:.1f} M fp32 parameters, "
        f"{where}, median of {rounds} steps")
    res = bench(shapes, rounds, device, mesh, triton_configs)
    floor = {}
    if device == "cuda" and mesh is None:
        bandwidth = copy_bandwidth()
        floor = {fam: b * numel / bandwidth * 1e3 for fam, b in FLOOR_BYTES.items()}
        say(f"  bytes floor at the copy's {bandwidth / 1e12:.2f} TB/s: " + ", ".join(
            f"{fam} {FLOOR_BYTES[fam]} B/param = {ms:.2f} ms" for fam, ms in floor.items()))
    best = {}
    for fam in ("adamw", "sgd"):
        entries = [(ms, label) for label, (f, ms) in res.items() if f == fam]
        best[fam] = min(entries) if entries else None
    for label, (fam, ms) in res.items():
        over = f"  {ms / floor[fam]:5.2f}x its floor" if fam in floor else ""
        say(f"  {label:30s} {ms:8.{2 if device == 'cuda' else 1}f} ms{over}")
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
    ap.add_argument("--triton-config", action="append", default=[], metavar="C,B,W",
                    help="also time the Triton kernel with chunks of C elements, blocks of B "
                         "and W warps (CUDA; repeat for several)")
    args = ap.parse_args()
    try:
        args.triton_configs = [tuple(int(x) for x in c.split(",")) for c in args.triton_config]
    except ValueError:
        ap.error("--triton-config takes CHUNK,BLOCK,WARPS, e.g. 16384,1024,4")
    if any(len(c) != 3 for c in args.triton_configs) or (args.triton_configs
                                                          and args.device != "cuda"):
        ap.error("--triton-config takes CHUNK,BLOCK,WARPS, with --device cuda")
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
    extra = args.triton_configs
    if args.model in ("resnet50", "both"):
        report("ResNet-50-shaped", resnet50_shapes(), args.rounds, args.device, mesh, extra)
    if args.model in ("bert", "both"):
        report("BERT-base-shaped", bert_base_shapes(), args.rounds, args.device, mesh, extra)
    if args.model == "bert-large":
        report("BERT-large-shaped", bert_large_shapes(), args.rounds, args.device, mesh, extra)


if __name__ == "__main__":
    main()
