"""Predicted against measured step time on one GPU: a charlm Transformer and a GPT-2-small
shape, fp32 and bf16 autocast, AdamW and LAMB.

    python benchmarks/plan_time_gpu.py --out "$OUT"    # estimated 30-60 s on an H200
    OMP_NUM_THREADS=1 python benchmarks/plan_time_gpu.py --device cpu --small  # smoke run
    python benchmarks/plan_time_gpu.py --from-json time_gpu.json --write-page
    python benchmarks/plan_time_gpu.py --from-json docs/plan/time_gpu.json  # no GPU: the
                                       # current model against the saved measurements

In one run on one device: calibrates it first (bigbatch/planner/calibrate.py's matrix-product
rate in float32 and bfloat16, copy bandwidth and per-kernel overhead, taken on that device,
plus a causal fused attention's forward and backward in each dtype), then for each case
runs `prepare()`'s real step (one micro-batch a step, world 1), takes the median of
``--steps`` timed steps after ``--warmup`` (CUDA events around each step), plans the same
layout with `bigbatch.plan` at world 1 on the meta device and predicts its step twice: on
the built-in device entry ``--entry`` (h200 on CUDA: the GPU lent here is an H200) and on
the calibrated description. Prints each case's measured and predicted milliseconds, the
ratios (predicted / measured) and the predicted compute and optimizer parts; writes the
JSON to ``--out`` (a folder gets time_gpu.json, written again after each case) and, with
``--write-page``, the table between the ``plan-time-gpu`` markers of docs/plan-time.md and
the run at docs/plan/time_gpu.json. A case that fails (out of memory, say) is a row with
its error and the run goes on. Timing lives here, never in the tests.

``--from-json FILE`` re-checks the time model without a GPU: it plans every saved case
again with the current code and predicts it on the saved devices (the run's entry and its
calibrated descriptions, as that GPU measured them), keeping the measured steps as the GPU
gave them; the ratios are the new predictions over those measurements, and the JSON
records when and from which commit the predictions came (``"predicted"``).
``--saved-predictions`` prints the run's own predictions instead. ``--write-page`` writes
either to the page and docs/plan/time_gpu.json.

``--profile`` (on the GPU) also runs one more step of each case under torch.profiler and
keeps the device's busy time in it (the sum of its kernels' durations) and the number of
kernels: a step much longer than its busy time waited on the host.

Cases (``--small``: tiny shapes of the same kinds, for a CPU):

- charlm: CharTransformer, vocabulary 96, d_model 1024, 8 layers, 16 heads, sequence 512,
  micro-batch 8;
- gpt2-small: CharTransformer at GPT-2 small's shape (vocabulary 50257, d_model 768, 12
  layers, 12 heads, sequence 1024, tied embedding, pre-LayerNorm, GELU), micro-batch 8.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bigbatch import Strategy, plan, prepare  # noqa: E402
from bigbatch.parallel.world import World  # noqa: E402
from bigbatch.planner.calibrate import copy_bandwidth, kernel_overhead, matmul_rate  # noqa: E402
from bigbatch.planner.devices import Device, device, device_from_dict  # noqa: E402
from bigbatch.tasks.charlm import CharTransformer  # noqa: E402

OUT = ROOT / "docs" / "plan" / "time_gpu.json"
PAGE = ROOT / "docs" / "plan-time.md"
MARKERS = ("<!-- plan-time-gpu -->", "<!-- /plan-time-gpu -->")
CASES = {
    "charlm": {"vocab": 96, "seq": 512, "d_model": 1024, "n_layer": 8, "n_head": 16,
               "micro": 8},
    "gpt2-small": {"vocab": 50257, "seq": 1024, "d_model": 768, "n_layer": 12,
                   "n_head": 12, "micro": 8},
}
SMALL = {
    "charlm": {"vocab": 96, "seq": 128, "d_model": 256, "n_layer": 2, "n_head": 4,
               "micro": 4},
    "gpt2-small": {"vocab": 4096, "seq": 128, "d_model": 192, "n_layer": 2, "n_head": 3,
                   "micro": 4},
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def build(case: dict) -> CharTransformer:
    return CharTransformer(case["vocab"], case["seq"], d_model=case["d_model"],
                           n_layer=case["n_layer"], n_head=case["n_head"])


def strategy(case: dict, dtype: str, optimizer: str) -> Strategy:
    d = {"batch": {"global_batch_size": case["micro"], "micro_batch_size": case["micro"]},
         "optimizer": {"type": "adamw"}}
    if optimizer == "lamb":
        d["lamb"] = {}
    if dtype == "bf16":
        d["amp"] = {"dtype": "bfloat16"}
    return Strategy.from_dict(d)


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten(), reduction="sum")


# -- calibration ---------------------------------------------------------------------------

def attention_rate(dtype: torch.dtype, shape: tuple[int, int, int, int], dev: str) -> float:
    """FLOP/s of a causal fused attention, forward and backward, counting what the planner
    counts for it: torch's FLOP count, halved for the causal mask."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = (torch.randn(shape, dtype=dtype, device=dev, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, dtype=dtype, device=dev)

    def step() -> None:  # forward and backward, nothing else (no loss, no .grad to add to)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    work = (sdpa_flop_count(shape, shape, shape)
            + sdpa_backward_flop_count(shape, shape, shape, shape)) / 2
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    inner = 10 if dev.startswith("cuda") else 2
    step()
    sync()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(inner):
            step()
        sync()
        times.append((time.perf_counter() - start) / inner)
    return work / statistics.median(times)


def calibrate_device(dev: str, entry: Device, small: bool) -> dict[str, Device]:
    """One calibrated description per dtype case (they differ only in how fast attention
    runs against the products: the device file has one attention efficiency)."""
    cuda = dev.startswith("cuda")
    n = 4096 if cuda else 512
    nbytes = 2**30 if cuda else 64 * 2**20
    shape = (2, 4, 64, 16) if small else (8, 16, 1024, 64)
    rates = {name: matmul_rate(getattr(torch, dt), n=n, device=dev)
             for name, dt in DTYPES.items()}
    base = Device(
        name=(torch.cuda.get_device_name(dev) if cuda else platform.processor() or "CPU")
        + ", calibrated",
        flops={"float32": rates["fp32"], "bfloat16": rates["bf16"],
               "float16": rates["bf16"]},
        memory_bandwidth=copy_bandwidth(nbytes, device=dev), intra=entry.intra,
        inter=entry.inter, gpus_per_node=entry.gpus_per_node, matmul_efficiency=1.0,
        attention_efficiency=1.0, memory_efficiency=1.0,
        kernel_overhead=kernel_overhead(device=dev),
        source=f"benchmarks/plan_time_gpu.py, {time.strftime('%Y-%m-%d')}: {n}^3 products, "
               f"a {nbytes // 2**20} MiB copy, a 1-element add, causal attention {shape} "
               "forward and backward (medians); links copied from the entry (unused at "
               "world 1)")
    out = {}
    for name, dt in DTYPES.items():
        eff = attention_rate(getattr(torch, dt), shape, dev) / rates[name]
        out[name] = replace(base, attention_efficiency=eff)
    return out


# -- measuring and predicting --------------------------------------------------------------

def measure(case: dict, dtype: str, optimizer: str, dev: str, steps: int, warmup: int,
            profile: bool = False) -> dict:
    """`prepare()`'s run of the case: the seconds of each timed step (``steps``), the
    seconds the host took to hand each to the device (``host``: until the step's Python
    returned, before waiting on the device; a step that waits on the host has the two
    alike) and, with `profile`, one more step under torch.profiler (``profile``)."""
    torch.manual_seed(0)
    cuda = dev.startswith("cuda")
    run = prepare(build(case), strategy(case, dtype, optimizer),
                  total_steps=warmup + steps + 2, world=World(device=torch.device(dev)))
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randint(0, case["vocab"], (case["micro"], case["seq"]), device=dev,
                      generator=gen)
    y = torch.randint(0, case["vocab"], (case["micro"], case["seq"]), device=dev,
                      generator=gen)

    def step() -> None:
        with run.micro_step() as ms:
            ms.backward(loss(run.model(x), y), count=y.numel())

    out: dict = {"steps": [], "host": []}
    try:
        for i in range(warmup + steps):
            if cuda:
                torch.cuda.synchronize(dev)
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            t0 = time.perf_counter()
            step()
            host = time.perf_counter() - t0
            if cuda:
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                seconds = host
            if i >= warmup:
                out["steps"].append(seconds)
                out["host"].append(host)
        if profile:
            out["profile"] = profile_step(step, cuda, dev)
    finally:
        run.close()
        run = None  # the step's closure holds the name: drop the model before collecting
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def profile_step(step, cuda: bool, dev: str) -> dict:
    """One step under torch.profiler: the device's kernels (each a device event) and the
    sum of their durations, the device's busy time (one stream: they do not overlap)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        if cuda:
            torch.cuda.synchronize(dev)
        with profile(activities=activities) as prof:
            step()
            if cuda:
                torch.cuda.synchronize(dev)
        if not cuda:
            return {"note": "no device events on the CPU"}
        device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        return {"device_events": len(device),
                "device_busy_s": sum(e.time_range.elapsed_us() for e in device) / 1e6}
    except Exception as e:  # the profile is extra: it must not lose the measured row
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}


def predict(case: dict, dtype: str, optimizer: str, devices: dict[str, Device]) -> dict:
    planned = plan(lambda: build(case), strategy(case, dtype, optimizer), 1, loss=loss,
                   example=lambda b: (torch.zeros(b, case["seq"], dtype=torch.long),) * 2)
    return {name: planned.time(d).to_dict() for name, d in devices.items()}


def repredict(result: dict) -> dict:
    """`result` (a saved run) with every measured row predicted again by the current time
    model on the run's own devices; measured numbers are kept as they are."""
    entry = device_from_dict(result["entry_device"], "the saved entry")
    calibrated = {k: device_from_dict(d, f"the saved calibrated {k}")
                  for k, d in result["calibrated_devices"].items()}
    rows = []
    for row in result["rows"]:
        if "error" not in row:
            t = predict(result["cases"][row["case"]], row["dtype"], row["optimizer"],
                        {"entry": entry, "calibrated": calibrated[row["dtype"]]})
            row = {**row, **_predicted(t, row["measured_s"])}
        rows.append(row)
    return {**result, "rows": rows, "predicted": _provenance()}


def _provenance() -> dict:
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, text=True, capture_output=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--", "bigbatch", "benchmarks/plan_time_gpu.py"):
        commit += " with uncommitted changes"
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit,
            "by": "benchmarks/plan_time_gpu.py --from-json: the current time model on the "
                  "saved cases and devices; measured steps as the run gave them"}


def _predicted(t: dict, real: float) -> dict:
    """A row's prediction fields from `predict`'s answer and the measured median `real`."""
    entry, cal = t["entry"]["step_seconds"], t["calibrated"]["step_seconds"]
    return {"predicted_entry_s": entry, "ratio_entry": entry / real,
            "predicted_calibrated_s": cal, "ratio_calibrated": cal / real,
            "breakdown_entry_s": t["entry"]["breakdown_seconds"],
            "breakdown_calibrated_s": t["calibrated"]["breakdown_seconds"],
            "mfu_entry": t["entry"]["mfu"], "dtype_planned": t["entry"]["dtype"]}


# -- the table -----------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}" if s >= 0.01 else f"{s * 1e3:.2f}"


def table(result: dict) -> list[str]:
    """The rows as a Markdown table; the host's and the profiled device's columns only for
    a run that measured them (runs before them lack the fields)."""
    measured = [r for r in result["rows"] if "error" not in r]
    host = any("host_s" in r for r in measured)
    busy = any("device_busy_s" in r.get("profile", {}) for r in measured)
    extra = (["host (median, ms)"] if host else []) + (["device busy (ms)"] if busy else [])
    head = ["case", "dtype", "optimizer", "measured (median, ms)", *extra,
            "predicted, entry (ms)", "entry / measured", "predicted, calibrated (ms)",
            "calibrated / measured", "compute, entry / calibrated (ms)",
            "optimizer, entry / calibrated (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['dtype']} | {r['optimizer']} | failed: "
                         f"{r['error'][:80]} |" + " |" * (len(head) - 4))
            continue
        e, c = r["breakdown_entry_s"], r["breakdown_calibrated_s"]
        more = ([_ms(r["host_s"]) if "host_s" in r else ""] if host else []) + (
            [_ms(r["profile"]["device_busy_s"]) if "device_busy_s" in r.get("profile", {})
             else ""] if busy else [])
        cells = [r["case"], r["dtype"], r["optimizer"], _ms(r["measured_s"]), *more,
                 _ms(r["predicted_entry_s"]), f"{r['ratio_entry']:.2f}",
                 _ms(r["predicted_calibrated_s"]), f"{r['ratio_calibrated']:.2f}",
                 f"{_ms(e['compute'])} / {_ms(c['compute'])}",
                 f"{_ms(e['optimizer'])} / {_ms(c['optimizer'])}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary(result: dict) -> str:
    rows = [r for r in result["rows"] if "error" not in r]
    near = {k: sum(abs(r[f"ratio_{k}"] - 1) <= 0.1 for r in rows)
            for k in ("entry", "calibrated")}
    again = result.get("predicted")
    redone = (f" Predicted again on {again['date']} (commit {again['commit']}) by "
              "`--from-json` on the run's saved devices; the measured steps are the run's own."
              if again else "")
    return (f"{result['device_name']} (torch {result['torch']}, {result['date']}), entry "
            f"`{result['entry']}`, median of {result['steps']} steps after "
            f"{result['warmup']}: within 10% of measured, entry {near['entry']} of "
            f"{len(rows)} rows, calibrated {near['calibrated']} of {len(rows)}.{redone}")


def write_page(result: dict) -> None:
    """The table between the page's markers, and the run it came from at docs/plan/time_gpu.json
    (the file the page's numbers come from)."""
    if result["small"]:
        sys.exit("plan_time_gpu: a --small run is a smoke test; its table stays off the page")
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    text = PAGE.read_text()
    start, end = MARKERS
    head, rest = text.split(start)
    _, tail = rest.split(end)
    body = [summary(result), "", *table(result)]
    PAGE.write_text(head + start + "\n" + "\n".join(body) + "\n" + end + tail)


def one_case(name: str, case: dict, dtype: str, opt: str, dev: str,
             args: argparse.Namespace, devices: dict[str, Device]) -> dict:
    """The case measured and predicted, as a row; a failure (out of memory, say) is a row
    with its error, and the run goes on to the next case."""
    row = {"case": name, "dtype": dtype, "optimizer": opt}
    try:
        measured = measure(case, dtype, opt, dev, args.steps, args.warmup, args.profile)
        t = predict(case, dtype, opt, devices)
    except Exception as e:  # one failed case must not lose the others' numbers
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"{name:>10} {dtype} {opt:>5}: failed: {row['error']}", flush=True)
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        return row
    times = measured["steps"]
    real = statistics.median(times)
    row.update(measured_s=real, measured_steps_s=times,
               host_s=statistics.median(measured["host"]), host_steps_s=measured["host"],
               **_predicted(t, real))
    if "profile" in measured:
        row["profile"] = measured["profile"]
    entry, cal = row["predicted_entry_s"], row["predicted_calibrated_s"]
    print(f"{name:>10} {dtype} {opt:>5}: measured {_ms(real):>7} ms (host "
          f"{_ms(row['host_s'])} ms), entry {_ms(entry):>7} ms ({entry / real:.2f}), "
          f"calibrated {_ms(cal):>7} ms ({cal / real:.2f})", flush=True)
    return row


def _out_path(arg: str) -> Path:
    path = Path(arg)
    return path if path.suffix == ".json" else path / "time_gpu.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--entry", default=None,
                        help="the built-in device entry to predict on (default h200 on "
                             "CUDA, cpu on the CPU)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: "
                        + ", ".join(CASES))
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--optimizers", default="adamw,lamb",
                        help="comma-separated: adamw, lamb")
    parser.add_argument("--profile", action="store_true",
                        help="one more step of each case under torch.profiler: the "
                             "device's busy time and kernel count in it")
    parser.add_argument("--out", default=str(OUT),
                        help="the JSON file, or a folder to hold time_gpu.json")
    parser.add_argument("--write-page", action="store_true",
                        help="write the table between docs/plan-time.md's markers")
    parser.add_argument("--from-json", metavar="FILE",
                        help="a saved run: predict its cases again with the current model "
                             "(measured steps kept) and print (and --write-page) it, "
                             "without a GPU")
    parser.add_argument("--saved-predictions", action="store_true",
                        help="with --from-json: print the run's own predictions instead")
    args = parser.parse_args()
    for flag, given, known in (("--cases", args.cases, CASES), ("--dtypes", args.dtypes, DTYPES),
                               ("--optimizers", args.optimizers, ("adamw", "lamb"))):
        bad = [v for v in given.split(",") if v not in known]
        if bad:
            parser.error(f"{flag}: unknown {bad[0]!r}; choose from {', '.join(known)}")
    if args.saved_predictions and not args.from_json:
        parser.error("--saved-predictions: only with --from-json")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        if not args.saved_predictions:
            result = repredict(result)
        print("\n".join(table(result)) + "\n" + summary(result))
        if args.write_page:
            write_page(result)
        return
    wall = time.perf_counter()
    dev = args.device
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            sys.exit("plan_time_gpu: no CUDA device here; pass --device cpu --small")
        dev = str(torch.device(dev if ":" in dev else "cuda:0"))
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    entry_name = args.entry or ("h200" if dev.startswith("cuda") else "cpu")
    entry = device(entry_name)
    shapes = SMALL if args.small else CASES
    calibrated = calibrate_device(dev, entry, args.small)
    print(f"calibrated in {time.perf_counter() - wall:.1f} s: products "
          f"{calibrated['fp32'].flops['float32'] / 1e12:.3g} (fp32) and "
          f"{calibrated['bf16'].flops['bfloat16'] / 1e12:.3g} (bf16) TFLOP/s, copy "
          f"{calibrated['fp32'].memory_bandwidth / 1e9:.3g} GB/s, "
          f"{calibrated['fp32'].kernel_overhead * 1e6:.2f} us a kernel, attention at "
          f"{calibrated['fp32'].attention_efficiency:.2f} (fp32) and "
          f"{calibrated['bf16'].attention_efficiency:.2f} (bf16) of the products' rate",
          flush=True)
    out = _out_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": dev, "device_name": calibrated["fp32"].name.removesuffix(", calibrated"),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "entry": entry_name,
        "steps": args.steps, "warmup": args.warmup, "small": args.small,
        "cases": {name: shapes[name] for name in args.cases.split(",")},
        "entry_device": entry.to_dict(),
        "calibrated_devices": {k: d.to_dict() for k, d in calibrated.items()}, "rows": []}
    for name in args.cases.split(","):
        for dtype in args.dtypes.split(","):
            for opt in args.optimizers.split(","):
                row = one_case(name, shapes[name], dtype, opt, dev, args,
                               {"entry": entry, "calibrated": calibrated[dtype]})
                result["rows"].append(row)
                result["wall_seconds"] = time.perf_counter() - wall
                # Each row as soon as it is measured: a run cut short keeps what it has.
                out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(table(result)) + "\n" + summary(result))
    print(f"wrote {out} in {result['wall_seconds']:.1f} s", flush=True)
    if args.write_page:
        write_page(result)


if __name__ == "__main__":
    main()
