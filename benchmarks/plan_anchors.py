"""The time model against published throughput: each anchor's layout planned on the meta
device with `examples/llama.py`'s model, its step predicted on the anchor's device, and
the predicted rate beside the published one.

    OMP_NUM_THREADS=1 python benchmarks/plan_anchors.py      # ~2-4 min on 2 cores

Writes docs/plan/anchors.json and the table between the ``plan-anchors`` markers of
docs/plan-time.md. The published numbers and configurations, with their sources, are in
`ANCHORS` below; where a source leaves a setting open, the choice made here is named in
the row's ``assumed``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bigbatch  # noqa: E402
from bigbatch.planner.devices import device  # noqa: E402
from bigbatch.planner.own_model import plan_model  # noqa: E402

OUT = ROOT / "docs" / "plan" / "anchors.json"
PAGE = ROOT / "docs" / "plan-time.md"
TORCHTITAN = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (arXiv 2410.06511), "
              "Table {}, row 'FSDP' (no torch.compile, no Float8): Llama 3.1 8B, local batch "
              "2, sequence 8192, selective activation checkpointing (torchtitan 9dec370's "
              "train_configs/llama3_8b.toml: selective_ac_option = 'op'), FSDP2 with bf16 "
              "parameters and float32 reduction (its mixed_precision_param and _reduce "
              "defaults); 96 GB HBM2e H100s at a 500 W power limit")
LLAMA3 = ("The Llama 3 Herd of Models (arXiv 2407.21783), Table 4 and section 3.3.2: 405B, "
          "sequence 8192, 16M tokens a batch, TP 8, PP 16, interleaved schedule, FSDP not "
          "resharding parameters after forward, no activation checkpointing")
H100_NVL_BF16 = 835e12
"""H100 NVL's dense bf16 peak (datasheet: 1,671 TFLOP/s with sparsity), 350-400 W: the low
end of torchtitan's statement that its 500 W GPUs' peak "is between SXM and NVL"."""


def _every_other(n: int) -> list[str]:
    return [f"blocks.{i}" for i in range(0, n, 2)]


LLAMA3_CHUNKS = [f"blocks.{i}" for i in range(126)] + ["norm"]
"""Where Llama 3 405B's 128 pipeline chunks (16 ranks x 8) begin: the embedding alone, each
of the 126 blocks alone, then the final norm with the output projection and the loss."""


ANCHORS = [
    {"name": "torchtitan 8B FSDP, 8 H100", "model": "llama3_8b", "world": 8,
     "device": "h100-hbm2e", "source": TORCHTITAN.format(1),
     "published": 5762, "metric": "tokens/s per GPU", "options": {},
     "low_peak": {"bfloat16": H100_NVL_BF16},
     "strategy": {"batch": {"micro_batch_size": 2, "global_batch_size": 16},
                  "sharding": {"stage": 3}, "amp": {"enable": True, "dtype": "bfloat16"},
                  "recompute": {"checkpoints": _every_other(32)}},
     "assumed": "selective AC as every other block recomputed (torchtitan's 'op' policy "
                "saves attention and every other product's output: it recomputes 3 of a "
                "block's 7 products, no attention, all elementwise kernels; about the same "
                "time on this model's costs); float32 parameters, bf16 compute under "
                "autocast (norms and loss in float32, as torchtitan's explicit upcasts); the "
                "power-limited peak between SXM's 989 and NVL's 835 TFLOP/s (both given)"},
    {"name": "torchtitan 8B FSDP, 128 H100", "model": "llama3_8b", "world": 128,
     "device": "h100-hbm2e", "source": TORCHTITAN.format(3),
     "published": 5605, "metric": "tokens/s per GPU", "options": {},
     "low_peak": {"bfloat16": H100_NVL_BF16},
     "strategy": {"batch": {"micro_batch_size": 2, "global_batch_size": 256},
                  "sharding": {"stage": 3}, "amp": {"enable": True, "dtype": "bfloat16"},
                  "recompute": {"checkpoints": _every_other(32)}},
     "assumed": "as above"},
    {"name": "Llama 3 405B, 8192 H100 (DP 64)", "model": "llama3_405b", "world": 8192,
     "device": "h100", "source": LLAMA3 + ", DP 64, batch 32 per DP rank",
     "published": 430, "metric": "model TFLOP/s per GPU (43% MFU)", "ends_only": False,
     "strategy": {"batch": {"micro_batch_size": 1, "global_batch_size": 2048},
                  "tensor_parallel": {"tensor_parallel_degree": 8},
                  "pipeline": {"pp_degree": 16, "accumulate_steps": 32,
                               "schedule_mode": "Interleaved1F1B", "virtual_stages": 8,
                               "split_points": LLAMA3_CHUNKS},
                  "sharding": {"stage": 2}},
     "assumed": "8 chunks a rank of one block each, the first only the embedding, the last "
                "only the output and loss (derived: the paper takes one layer from the first "
                "and last stages and says those chunks then hold only the embedding and the "
                "output, so a chunk is one layer: 126 + 2 = 128 = 16 x 8); micro-batch 1 "
                "sequence (32 micro-batches); ZeRO-2; tensor-parallel all-reduces exposed "
                "(the paper does not say they overlap)"},
    {"name": "Llama 3 405B, 16384 H100 (DP 128)", "model": "llama3_405b", "world": 16384,
     "device": "h100", "source": LLAMA3 + ", DP 128, batch 16 per DP rank",
     "published": 400, "metric": "model TFLOP/s per GPU (41% MFU)", "ends_only": False,
     "strategy": {"batch": {"micro_batch_size": 1, "global_batch_size": 2048},
                  "tensor_parallel": {"tensor_parallel_degree": 8},
                  "pipeline": {"pp_degree": 16, "accumulate_steps": 16,
                               "schedule_mode": "Interleaved1F1B", "virtual_stages": 8,
                               "split_points": LLAMA3_CHUNKS},
                  "sharding": {"stage": 2}},
     "assumed": "as above (16 micro-batches)"},
    {"name": "Megatron-LM 1T, 3072 A100", "model": "megatron_1t", "world": 3072,
     "device": "a100",
     "source": "Narayanan et al. 2021 (arXiv 2104.04473) Table 1; configuration from "
               "Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh: TP 8, PP 64, "
               "micro-batch 1, global 3072, sequence 2048, full recompute, fp16",
     "published": 163, "metric": "TFLOP/s per GPU, recompute included (52% of peak)",
     "strategy": {"batch": {"micro_batch_size": 1, "global_batch_size": 3072},
                  "tensor_parallel": {"tensor_parallel_degree": 8},
                  "pipeline": {"pp_degree": 64, "accumulate_steps": 512},
                  "recompute": {"checkpoints": [f"blocks.{i}" for i in range(128)]}},
     "assumed": "1F1B, gradients all-reduced over the 6 data ranks after the last "
                "micro-batch; Adam"},
]


def _strategy(spec: dict) -> bigbatch.Strategy:
    d = {"optimizer": {"type": "adamw"}, **spec}
    if "pipeline" in d:
        d["pipeline"] = {"enable": True, **d["pipeline"]}
    if "recompute" in d:
        d["recompute"] = {"enable": True, **d["recompute"]}
    return bigbatch.Strategy.from_dict(d)


def _rate(anchor: dict, t) -> float:
    if anchor["metric"].startswith("tokens"):
        return t.per_device_rate
    if anchor["metric"].startswith("model"):
        return t.model_tflops_per_device
    return t.tflops_per_device


def predict(anchor: dict) -> dict:
    """One anchor planned and predicted; with ``low_peak`` (a source that bounds its
    device's peak from below), predicted again at that peak."""
    started = time.perf_counter()
    planned = plan_model(f"examples.llama:{anchor['model']}", _strategy(anchor["strategy"]),
                         anchor["world"], options=anchor.get("options", {"dtype": "bfloat16"}),
                         seq_len=None, ends_only=anchor.get("ends_only", True))
    dev = device(anchor["device"])
    t = planned.time(dev)
    predicted = _rate(anchor, t)
    row = {**{k: anchor[k] for k in ("name", "model", "world", "device", "source",
                                      "published", "metric", "assumed")},
           "predicted": predicted, "ratio": predicted / anchor["published"],
           "mfu": t.mfu, "time": t.to_dict(), "mesh": planned.mesh,
           "planned_seconds": round(time.perf_counter() - started, 1)}
    if "low_peak" in anchor:
        low = replace(dev, flops={**dev.flops, **anchor["low_peak"]})
        row["low_peak"] = {"flops": anchor["low_peak"], "predicted": _rate(anchor, planned.time(low))}
        row["low_peak"]["ratio"] = row["low_peak"]["predicted"] / anchor["published"]
    return row


def table(rows: list[dict]) -> str:
    lines = ["| anchor | device | metric | published | predicted | predicted / published | "
             "at the low peak | step (s) | compute | exposed comm | bubble | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["time"]["breakdown_seconds"]
        comm = sum(v for k, v in b.items() if k.startswith("comm_"))
        low = f"{r['low_peak']['ratio']:.2f}" if "low_peak" in r else "-"
        lines.append(
            f"| {r['name']} | {r['device']} | {r['metric']} | {r['published']:g} | "
            f"{r['predicted']:.0f} | {r['ratio']:.2f} | {low} | "
            f"{r['time']['step_seconds']:.2f} | "
            f"{b['compute']:.2f} | {comm:.2f} | {b['bubble']:.2f} | {r['mfu']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    rows = []
    for anchor in ANCHORS:
        row = predict(anchor)
        print(f"{row['name']}: predicted {row['predicted']:.0f} vs published "
              f"{row['published']} ({row['ratio']:.2f}x), planned in "
              f"{row['planned_seconds']} s", flush=True)
        rows.append(row)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    text = PAGE.read_text()
    start, end = "<!-- plan-anchors -->", "<!-- /plan-anchors -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    PAGE.write_text(head + start + "\n" + table(rows) + "\n" + end + tail)


if __name__ == "__main__":
    main()
