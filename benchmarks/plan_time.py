"""Predicted against measured step time on this CPU, for the layouts the test suite runs.

    OMP_NUM_THREADS=1 python benchmarks/plan_time.py        # ~3 min on 2 cores

Calibrates this machine first (`bigbatch plan --calibrate`'s measurements, in the same
run), then for each layout - one process; 2 gloo ranks with DDP, ZeRO-1, ZeRO-3, tensor
degree 2, a 2-stage pipeline; with and without merged micro-batches - runs
`prepare()`'s real step on a charlm Transformer, takes the median of its timed steps,
plans the same layout on the meta device and predicts its step on the calibrated device.
Prints each pair and the ratio; writes docs/plan/time_cpu.json and the table between the
``plan-time-cpu`` markers of docs/plan-time.md. Timing lives here, never in the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._gloo import run_on_workers  # noqa: E402
from bigbatch.config.strategy import Strategy  # noqa: E402
from bigbatch.planner import plan  # noqa: E402
from bigbatch.planner.calibrate import calibrate  # noqa: E402
from bigbatch.tasks.charlm import TENSOR_PARALLEL_PLAN, CharTransformer  # noqa: E402

OUT = ROOT / "docs" / "plan" / "time_cpu.json"
PAGE = ROOT / "docs" / "plan-time.md"
VOCAB, SEQ, MICRO, D, LAYERS, HEADS = 96, 128, 8, 256, 4, 4
LAYOUTS = [("single", 1, 1), ("single", 2, 1), ("ddp", 1, 2), ("ddp", 2, 2),
           ("zero1", 1, 2), ("zero3", 1, 2), ("zero3", 2, 2), ("tp2", 1, 2),
           ("pp2", 4, 2)]
"""(mode, micro-batches per step, ranks)."""
TIMED, WARMUP = 7, 2


def model() -> CharTransformer:
    return CharTransformer(VOCAB, SEQ, d_model=D, n_layer=LAYERS, n_head=HEADS)


def strategy(mode: str, k: int, world: int) -> Strategy:
    tensor = 2 if mode == "tp2" else 1
    stages = 2 if mode == "pp2" else 1
    data = world // (tensor * stages)
    d = {"batch": {"global_batch_size": MICRO * k * data},
         "optimizer": {"type": "adamw", "weight_decay": 0.0}}
    if stages > 1:
        d["pipeline"] = {"pp_degree": stages, "accumulate_steps": k}
    elif k > 1:
        d["gradient_merge"] = {"enable": True, "k_steps": k}
    if tensor > 1:
        d["tensor_parallel"] = {"tensor_parallel_degree": tensor}
    if mode.startswith("zero"):
        d["sharding"] = {"stage": int(mode[-1])}
    return Strategy.from_dict(d)


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


def _steps(run, gen: torch.Generator) -> list[float]:
    b = run.plan
    times = []
    for i in range(WARMUP + TIMED):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        if run.pipeline is not None:
            x = torch.randint(0, VOCAB, (b.micro_batch_size * b.k_steps, SEQ), generator=gen)
            run.pipeline_step(x, x, lambda o, y: (loss(o, y), y.numel()))
        else:
            for _ in range(b.k_steps):
                x = torch.randint(0, VOCAB, (b.micro_batch_size, SEQ), generator=gen)
                with run.micro_step() as ms:
                    ms.backward(loss(run.model(x), x), count=x.numel())
        if dist.is_initialized():
            dist.barrier()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def measure_one(mode: str, k: int, world: int) -> float:
    from bigbatch.engine.prepare import prepare

    torch.manual_seed(0)
    run = prepare(model(), strategy(mode, k, world), total_steps=100,
                  tp_plan=TENSOR_PARALLEL_PLAN if mode == "tp2" else None)
    try:
        return statistics.median(_steps(run, torch.Generator().manual_seed(1)))
    finally:
        run.close()


def _worker(rank: int, args: argparse.Namespace) -> None:
    out = {}
    for mode, k, world in LAYOUTS:
        if world == 2:
            out[f"{mode}/{k}"] = measure_one(mode, k, world)
    if rank == 0:
        Path(args.tmp).write_text(json.dumps(out))


def predict(mode: str, k: int, world: int, dev) -> dict:
    planned = plan(model, strategy(mode, k, world), world, loss=loss,
                   example=lambda b: (torch.zeros(b, SEQ, dtype=torch.long),) * 2,
                   tp_plan=TENSOR_PARALLEL_PLAN if mode == "tp2" else None)
    return planned.time(dev).to_dict()


def main() -> None:
    import tempfile

    torch.set_num_threads(1)
    dev = calibrate()
    measured = {f"{m}/{k}": measure_one(m, k, 1) for m, k, w in LAYOUTS if w == 1}
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        run_on_workers(_worker, argparse.Namespace(threads=1, tmp=tmp.name), world=2)
        measured.update(json.loads(Path(tmp.name).read_text()))
    rows = []
    for mode, k, world in LAYOUTS:
        t = predict(mode, k, world, dev)
        real = measured[f"{mode}/{k}"]
        rows.append({"layout": mode, "micro_batches": k, "ranks": world,
                     "measured_s": real, "predicted_s": t["step_seconds"],
                     "ratio": t["step_seconds"] / real,
                     "breakdown_s": t["breakdown_seconds"]})
        print(f"{mode:>6} k={k} ranks={world}: measured {real * 1e3:7.1f} ms, predicted "
              f"{t['step_seconds'] * 1e3:7.1f} ms, ratio {rows[-1]['ratio']:.2f}", flush=True)
    OUT.write_text(json.dumps({"device": dev.to_dict(), "model": {
        "d_model": D, "n_layer": LAYERS, "n_head": HEADS, "seq_len": SEQ, "micro": MICRO},
        "rows": rows}, indent=1) + "\n")
    lines = ["| layout | micro-batches | ranks | measured (median, ms) | predicted (ms) | "
             "predicted / measured |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['micro_batches']} | {r['ranks']} | "
                     f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['ratio']:.2f} |")
    text = PAGE.read_text()
    start, end = "<!-- plan-time-cpu -->", "<!-- /plan-time-cpu -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    PAGE.write_text(head + start + "\n" + "\n".join(lines) + "\n" + end + tail)


if __name__ == "__main__":
    main()
