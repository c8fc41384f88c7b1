"""The planner's time model: deterministic properties only (timing lives in
benchmarks/plan_time.py and benchmarks/plan_anchors.py).

Hand-computed collectives and links, FLOPs of known operators from torch's counter, the
breakdown summing to the step, monotonicity in the device and the pipeline, device files
read back and refused in one line, `--model module:function` through the CLI; autocast's
casts counted by hand, the optimizer costed on a steady step.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.config.strategy import Strategy
from bigbatch.errors import ConfigError
from bigbatch.planner import plan
from bigbatch.planner.calibrate import link_from_curve
from bigbatch.planner.cost import OpCost, cost_counting
from bigbatch.planner.devices import DEVICES, Device, Link, device, device_toml, load_device
from bigbatch.planner.timing import collective_seconds, dim_link
from bigbatch.tasks.charlm import CharTransformer

pytestmark = pytest.mark.usefixtures("one_thread")

H100 = DEVICES["h100"]


def test_ring_and_tree_collectives_by_hand():
    link = (100e9, 5e-6)
    # all-gather of 800 MB over 8: 7 hops + 7/8 of it on the wire.
    assert collective_seconds("all_gather", 800e6, 8, link) == pytest.approx(
        7 * 5e-6 + 7 / 8 * 800e6 / 100e9)
    # a large all-reduce: the ring (2 (n-1)/n S) beats the tree (2 S).
    assert collective_seconds("all_reduce", 1e9, 8, link) == pytest.approx(
        14 * 5e-6 + 2 * 7 / 8 * 1e9 / 100e9)
    # a tiny one over 1024 ranks: the tree's 2 log2(n) hops beat the ring's 2 (n-1).
    assert collective_seconds("all_reduce", 8, 1024, link) == pytest.approx(
        20 * 5e-6 + 2 * 8 / 100e9)
    # calls split the bytes and pay the hops each time.
    assert collective_seconds("point_to_point", 2e9, 2, link, calls=4) == pytest.approx(
        4 * (5e-6 + 0.5e9 / 100e9))
    assert collective_seconds("all_reduce", 1e9, 1, link) == 0


def test_links_follow_the_mesh():
    intra, inter = H100.intra, H100.inter
    assert dim_link(H100, 1, 8) == (intra.rate, intra.latency)      # tp 8: NVLink
    assert dim_link(H100, 8, 64) == (inter.rate, inter.latency)     # dp over nodes, 1 a node
    # 16 ranks 1 apart: 8 in a node share 8 NICs, capped by NVLink.
    assert dim_link(H100, 1, 16) == (min(intra.rate, 8 * inter.rate), inter.latency)
    assert dim_link(H100, 2, 16) == (4 * inter.rate, inter.latency)


def test_flops_of_a_linear_from_torchs_counter():
    layer = nn.Linear(64, 32, bias=False, device="meta")
    x = torch.empty(8, 64, device="meta", requires_grad=True)
    cost = OpCost()
    with cost_counting(cost) as backward:
        y = layer(x)
        backward[0] = True
        y.backward(torch.ones_like(y))
    forward = 2 * 8 * 64 * 32
    assert cost.forward_flops == forward
    assert cost.flops == 3 * forward  # the input's and the weight's gradients
    # roofline: compute-bound products cost flops / rate, plus one overhead a kernel.
    dev = replace(H100, kernel_overhead=0.0, memory_bandwidth=1e30)
    assert cost.seconds(dev) == pytest.approx(3 * forward / H100.matmul_rate("float32"))


def test_views_are_free_and_causal_attention_is_half_the_work():
    cost = OpCost()
    q = torch.empty(2, 4, 128, 16, device="meta")
    with cost_counting(cost):
        q.transpose(1, 2).unsqueeze(0)[0].view(2, 128, 4, 16)
    assert cost.kernels == 0 and cost.other_bytes == 0
    for causal, share in ((True, 0.5), (False, 1.0)):
        cost = OpCost()
        with cost_counting(cost):
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, causal)
        (dtype, flops, _, work), = cost.matmuls
        assert flops == 4 * 2 * 4 * 128 * 128 * 16 and work == share


def _strategy(**sections) -> Strategy:
    return Strategy.from_dict({"batch": {"micro_batch_size": 2},
                               "optimizer": {"type": "adamw"}, **sections})


def _model() -> CharTransformer:
    return CharTransformer(96, 64, d_model=64, n_layer=4, n_head=4)


def _example(b: int):
    return (torch.zeros(b, 64, dtype=torch.long),) * 2


@pytest.fixture(scope="module")
def zero3():
    return plan(_model, _strategy(sharding={"stage": 3}), 16, example=_example)


def test_breakdown_sums_to_the_step_and_rates_agree(zero3):
    t = zero3.time(H100)
    assert sum(t.breakdown().values()) == pytest.approx(t.seconds)
    assert set(t.breakdown()) >= {"compute", "comm_dp_shard", "bubble", "optimizer"}
    assert t.unit == "tokens" and zero3.tokens_per_sample == 64
    assert t.per_device_rate == pytest.approx(32 * 64 / t.seconds / 16)
    assert 0 < t.mfu < H100.matmul_efficiency
    assert t.model_tflops_per_device <= t.tflops_per_device


def test_a_faster_device_is_faster(zero3):
    slow = zero3.time(H100)
    for faster in (replace(H100, flops={k: 2 * v for k, v in H100.flops.items()}),
                   replace(H100, memory_bandwidth=2 * H100.memory_bandwidth),
                   replace(H100, inter=Link(10 * H100.inter.bandwidth, H100.inter.latency))):
        assert zero3.time(faster).seconds <= slow.seconds
    assert zero3.time(DEVICES["a100"]).seconds > slow.seconds


def test_pipeline_bubble_shrinks_with_micro_batches_and_chunks():
    def bubble_share(k: int, **pipe) -> float:
        s = _strategy(pipeline={"enable": True, "pp_degree": 2, "accumulate_steps": k, **pipe})
        t = plan(_model, s, 2, example=_example).time(H100)
        assert t.bubble > 0
        return t.bubble / t.seconds

    assert bubble_share(8) < bubble_share(2)
    assert bubble_share(4, schedule_mode="Interleaved1F1B", virtual_stages=2) < bubble_share(4)


def test_device_file_round_trip_and_refusals(tmp_path):
    path = tmp_path / "dev.toml"
    path.write_text(device_toml(H100))
    assert load_device(path) == H100
    js = tmp_path / "dev.json"
    js.write_text(json.dumps(DEVICES["cpu"].to_dict()))
    assert load_device(js) == DEVICES["cpu"]
    for text, key in (('name = "x"\n', "missing flops"),
                      (device_toml(H100).replace("memory_bandwidth = ", "memory_bandwith = "),
                       "unknown key 'memory_bandwith'"),
                      (device_toml(H100).replace("latency = 3e-06", "latency = -1"),
                       "latency = -1")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=key):
            load_device(path)
    with pytest.raises(ConfigError, match="not a known device"):
        device("tpu")


def test_calibrated_link_solves_the_ring_model():
    link = Link(2e9, 50e-6, 1.0)
    curve = {s: collective_seconds("all_reduce", s, 2, (link.rate, link.latency))
             for s in (4096, 2**24)}
    got = link_from_curve(curve)
    assert got.bandwidth == pytest.approx(2e9) and got.latency == pytest.approx(50e-6)
    assert isinstance(Device, type) and math.isfinite(got.rate)


LLAMA = ["plan", "--model", "examples.llama:llama", "--model-opt", "d_model=64",
         "--model-opt", "n_layer=2", "--model-opt", "n_head=4", "--model-opt", "n_kv_head=2",
         "--model-opt", "hidden=128", "--model-opt", "vocab=256", "--seq-len", "32"]


def test_cli_plans_your_own_model_and_its_time(capsys, monkeypatch):
    from bigbatch.cli.main import main
    from tests._cli import ROOT

    monkeypatch.chdir(ROOT)
    code = main([*LLAMA, "--world", "8", "--set", "tensor_parallel.tensor_parallel_degree=2",
                 "--set", "sharding.stage=3", "--device", "h200", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out)
    assert d["mesh"]["tp"] == 2 and d["comm_bytes_per_step"]["all_reduce"]["tp"] > 0
    t = d["time"]
    assert t["device"] == DEVICES["h200"].name and t["tokens_per_second_per_device"] > 0
    assert sum(t["breakdown_seconds"].values()) == pytest.approx(t["step_seconds"])
    assert "comm_tp" in t["breakdown_seconds"] and 0 < t["mfu"] < 1


@pytest.mark.parametrize("args, message", [
    (["--model", "examples.nothing:f", "--world", "2"], "--model 'examples.nothing:f'"),
    (["--model", "examples.llama:nope", "--world", "2"], "has no 'nope'"),
    ([*LLAMA[1:], "--world", "2", "--device", "tpu"], "--device 'tpu'"),
    ([*LLAMA[1:], "--world", "2", "--device-file", "/nonexistent.toml"], "--device-file"),
    ([*LLAMA[1:], "--world", "2", "--model-opt", "bad"], "--model-opt 'bad'"),
    (["--task", "charlm", "--seq-len", "8", "--world", "2"], "--seq-len: only with --model"),
    (["--task", "charlm"], "--world: required"),
])
def test_cli_refuses_bad_input_in_one_line(args, message, capsys, monkeypatch):
    from bigbatch.cli.main import main
    from tests._cli import ROOT

    monkeypatch.chdir(ROOT)
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if "Warning" not in line]
    assert code == 2 and out == ""
    assert len(lines) == 1 and message in lines[0], err


def test_llama_example_has_llama3_shapes():
    import importlib

    llama = importlib.import_module("examples.llama")
    expected = {"llama3_8b": 8.03e9, "llama3_70b": 70.6e9, "llama3_405b": 405.9e9,
                "megatron_1t": 1.008e12}
    for name, params in expected.items():
        with torch.device("meta"):
            model = getattr(llama, name)()
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.005)
    with torch.device("meta"):
        small = llama.llama(d_model=64, n_layer=1, n_head=4, n_kv_head=2, hidden=96, vocab=50)
    out = small(torch.zeros(2, 16, dtype=torch.long, device="meta"))
    assert out.shape == (2, 16, 50)
    assert F.silu is not None  # SwiGLU's gate


def _norm_then_linear() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 32, bias=False))


def _norm_then_linear_plan(**sections):
    s = Strategy.from_dict({"batch": {"micro_batch_size": 16},
                            "optimizer": {"type": "adamw"}, **sections})
    return plan(_norm_then_linear, s, 1,
                example=lambda b: (torch.zeros(b, 64), torch.zeros(b, 32)))


def test_autocast_counts_its_casts_by_hand():
    """bf16 autocast against float32 on LayerNorm(64) -> Linear(64, 32), micro-batch 16:
    four casts more, each 4 B read + 2 B written an element (or the reverse): the norm's
    16 x 64 output and the 32 x 64 weight to bfloat16 in forward (autocast's cached copy,
    once a micro-batch), their gradients back to float32 in backward. The norm runs in
    float32 either way; the products keep their FLOPs at half the bytes, and so does
    backward's seed (`ones_like` the 16 x 32 output, counted with the output it reads)."""
    b, d, h = 16, 64, 32
    fp32 = _norm_then_linear_plan().ranks[0].compute
    bf16 = _norm_then_linear_plan(amp={"dtype": "bfloat16"}).ranks[0].compute
    casts = 2 * 6 * (b * d + h * d)
    assert bf16.kernels - fp32.kernels == 4
    seed = 2 * 2 * b * h  # (4 - 2) B an element, of the output and of its ones
    assert bf16.other_bytes - fp32.other_bytes == casts - seed
    assert [(m[0], m[1], 2 * m[2]) for m in bf16.matmuls] == \
        [("bfloat16", m[1], m[2]) for m in fp32.matmuls]
    # On a device whose products are bound by their bytes, the step grows by the casts'
    # bytes and a kernel each, less what the products and the seed save.
    dev = replace(H100, flops={"float32": 1e30, "bfloat16": 1e30})
    bw = dev.memory_bandwidth * dev.memory_efficiency
    halved = sum(m[2] for m in fp32.matmuls) / 2
    assert bf16.seconds(dev) - fp32.seconds(dev) == pytest.approx(
        (casts - seed - halved) / bw + 4 * dev.kernel_overhead)


def test_host_step_counters_are_not_device_kernels():
    """torch's optimizers keep each parameter's step count on the host and read it with
    .item() for the bias corrections: no kernel on the device."""
    steps = [torch.tensor(1.0) for _ in range(3)]
    p = torch.empty(10, device="meta")
    cost = OpCost()
    with cost_counting(cost):
        torch._foreach_add_(steps, 1)
        [s.item() for s in steps]
        p.mul(2)
    assert cost.kernels == 1 and cost.other_bytes == 2 * 10 * 4


def test_the_optimizer_is_costed_on_a_steady_step():
    """A run's steps after its first: AdamW's first step fills its new state (a zeros_like
    for each moment of each parameter), which the planned cost leaves out."""
    from bigbatch.engine.optimizer import build_optimizer

    got = _norm_then_linear_plan().ranks[0].optimizer_cost
    with torch.device("meta"):
        model = _norm_then_linear()
    optimizer = build_optimizer(model, _strategy(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    first, second = OpCost(), OpCost()
    with cost_counting(first):
        optimizer.step()
    with cost_counting(second):
        optimizer.step()
    assert (got.kernels, got.other_bytes) == (second.kernels, second.other_bytes)
    tensors = len(list(model.parameters()))
    assert first.kernels - second.kernels == 2 * tensors
    assert first.other_bytes > second.other_bytes
    # foreach kernels over a group's tensors, none per tensor
    assert second.kernels <= 8 * len(optimizer.param_groups)


def _benchmark(name: str):
    """(benchmarks/NAME.py as a module, the repository root)."""
    import importlib.util

    from tests._cli import ROOT

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, ROOT


def _gpu_bench():
    return _benchmark("plan_time_gpu")


def test_a_saved_gpu_run_is_predicted_again_without_a_gpu():
    """`plan_time_gpu.py --from-json`: the current model on the saved cases and devices;
    the measured steps stay as the GPU gave them, a failed row stays as it was."""
    bench, _ = _gpu_bench()
    case = bench.SMALL["charlm"]
    entry = DEVICES["h200"]
    calibrated = replace(entry, kernel_overhead=1e-5, matmul_efficiency=1.0)
    measured = {"case": "charlm", "dtype": "bf16", "optimizer": "adamw", "measured_s": 0.01,
                "measured_steps_s": [0.01, 0.011], "predicted_entry_s": 1.0,
                "ratio_entry": 100.0, "predicted_calibrated_s": 1.0,
                "ratio_calibrated": 100.0}
    failed = {"case": "charlm", "dtype": "bf16", "optimizer": "lamb", "error": "OOM"}
    saved = {"device_name": "a GPU", "torch": "2.x", "date": "then", "entry": "h200",
             "steps": 2, "warmup": 1, "small": True, "cases": {"charlm": case},
             "entry_device": entry.to_dict(),
             "calibrated_devices": {"bf16": calibrated.to_dict()},
             "rows": [measured, failed]}
    again = bench.repredict(saved)
    want = bench.predict(case, "bf16", "adamw", {"entry": entry, "calibrated": calibrated})
    row = again["rows"][0]
    assert row["measured_s"] == 0.01 and row["measured_steps_s"] == [0.01, 0.011]
    for name in ("entry", "calibrated"):
        assert row[f"predicted_{name}_s"] == pytest.approx(want[name]["step_seconds"])
        assert row[f"ratio_{name}"] == pytest.approx(row[f"predicted_{name}_s"] / 0.01)
    assert again["rows"][1] == failed
    assert again["predicted"]["commit"] and "predicted" not in saved
    assert measured["predicted_entry_s"] == 1.0  # the saved run is not changed
    assert "Predicted again" in bench.summary(again)


def test_the_gpu_table_is_the_saved_run_and_float32_stays_within_10_percent():
    """docs/plan-time.md's one-GPU table is docs/plan/time_gpu.json as the script renders
    it; the issue's bar holds for its float32 rows, predicted again live."""
    bench, root = _gpu_bench()
    saved = json.loads((root / "docs" / "plan" / "time_gpu.json").read_text())
    start, end = bench.MARKERS
    page = (root / "docs" / "plan-time.md").read_text()
    section = page.split(start + "\n")[1].split("\n" + end)[0]
    assert section == "\n".join([bench.summary(saved), "", *bench.table(saved)])
    fp32 = {**saved, "rows": [r for r in saved["rows"] if r["dtype"] == "fp32"]}
    for row in bench.repredict(fp32)["rows"]:
        assert abs(row["ratio_calibrated"] - 1) <= 0.1, row


def _anchors_bench():
    return _benchmark("plan_anchors")


def test_the_anchors_table_is_the_saved_run():
    """docs/plan-time.md's table of published anchors is docs/plan/anchors.json as
    benchmarks/plan_anchors.py renders it, one row per anchor, in order."""
    bench, root = _anchors_bench()
    saved = json.loads((root / "docs" / "plan" / "anchors.json").read_text())
    page = (root / "docs" / "plan-time.md").read_text()
    section = page.split("<!-- plan-anchors -->\n")[1].split("\n<!-- /plan-anchors -->")[0]
    assert section == bench.table(saved)
    assert [r["name"] for r in saved] == [a["name"] for a in bench.ANCHORS]
    for row in saved:
        assert row["ratio"] == pytest.approx(row["predicted"] / row["published"])
        if "low_peak" in row:  # a lower peak predicts a slower step
            assert row["low_peak"]["predicted"] < row["predicted"]


def test_llama3_405b_chunks_are_the_papers_layout():
    """Llama 3's 405B pipeline (arXiv 2407.21783, 3.3.2): the first chunk only the
    embedding, the last only the output and loss, one block in each other chunk: 128 chunks
    for 16 ranks x 8."""
    from bigbatch.parallel.pipeline import split_layers
    from examples.llama import llama3_405b

    bench, _ = _anchors_bench()
    with torch.device("meta"):
        model = llama3_405b()
    chunks = split_layers(model, model.pipeline_layers(), 16 * 8, bench.LLAMA3_CHUNKS)
    layers = model.pipeline_layers()
    names = [[layers[i].name for i in r] for r in chunks]
    assert len(names) == 128 and names[0] == ["embed"] and names[-1] == ["norm", "head"]
    assert all(n == [f"blocks.{i}"] for i, n in enumerate(names[1:-1]))
    for anchor in bench.ANCHORS:
        if anchor["model"] == "llama3_405b":
            pipe = anchor["strategy"]["pipeline"]
            assert pipe["pp_degree"] * pipe["virtual_stages"] == 128
            assert pipe["split_points"] == bench.LLAMA3_CHUNKS
