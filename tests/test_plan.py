"""`bigbatch plan` / `bigbatch.plan`: layouts on the meta device and a fake process group.

Per-rank bytes equal the arithmetic of each layout at 8, 256 and 1024 ranks; the pipeline
bubble, the batch arithmetic and the activation probe have known answers; refused layouts
are refused in one line through the real CLI. Equality with real gloo runs is in
tests/test_plan_dist.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bigbatch
from bigbatch.config.strategy import Strategy
from bigbatch.errors import ConfigError
from bigbatch.planner import plan
from bigbatch.planner.counting import CommCount, counting, wire_bytes
from bigbatch.planner.traffic import fsdp_gathers, schedule_order
from bigbatch.tasks.charlm import TENSOR_PARALLEL_PLAN, CharTransformer
from tests._cli import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, LAYERS = 1024, 8  # every dim 0 divides 1024: no FSDP padding


def _square() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


P = WIDTH * WIDTH * LAYERS


def _strategy(optimizer: str = "lamb", **sections) -> Strategy:
    d = {"batch": {"micro_batch_size": 1}, "optimizer": {"type": "adamw"}}
    if optimizer == "lamb":
        d["lamb"] = {}
    elif optimizer == "lars":
        d["optimizer"] = {"type": "momentum"}
        d["lars"] = {}
    d.update(sections)
    return Strategy.from_dict(d)


@pytest.mark.parametrize("world", [8, 256, 1024])
def test_zero3_bytes_are_one_nth_of_sixteen_per_parameter(world):
    p = plan(_square, _strategy(sharding={"stage": 3}), world)
    b = p.to_dict()["per_rank_bytes"]
    assert (b["params"], b["grads"]) == (4 * P // world, 4 * P // world)
    # LAMB: two fp32 moments, and a 0-d step count per tensor.
    assert b["optimizer"] == 8 * P // world + 4 * LAYERS
    assert p.world == world and p.to_dict()["mesh"]["dp_shard"] == world


@pytest.mark.parametrize("world", [8, 256, 1024])
def test_stage0_holds_sixteen_bytes_per_parameter(world):
    b = plan(_square, _strategy(), world).to_dict()["per_rank_bytes"]
    assert b["params"] + b["grads"] + b["optimizer"] == 16 * P + 4 * LAYERS


@pytest.mark.parametrize("world", [8, 256])
def test_zero2_holds_the_state_of_zero3_at_the_step(world):
    b = plan(_square, _strategy(sharding={"stage": 2}), world).to_dict()["per_rank_bytes"]
    assert (b["params"], b["grads"], b["optimizer"]) == (
        4 * P // world, 4 * P // world, 8 * P // world + 4 * LAYERS)


def test_zero1_shards_whole_tensors_of_optimizer_state():
    # Eight equal tensors over eight ranks: one tensor's state each.
    b = plan(_square, _strategy(sharding={"stage": 1}), 8).to_dict()["per_rank_bytes"]
    assert (b["params"], b["grads"], b["optimizer"]) == (4 * P, 4 * P, 8 * P // 8 + 4)


def test_lars_keeps_one_momentum_buffer():
    b = plan(_square, _strategy("lars", sharding={"stage": 3}), 256).to_dict()["per_rank_bytes"]
    assert b["optimizer"] - 4 * P // 256 < 16 * LAYERS  # + a 0-d local_lr per tensor


@pytest.mark.parametrize("world", [8, 1024])
def test_tensor_and_zero3_divide_the_model_by_the_world(world):
    model = lambda: CharTransformer(96, 16, d_model=256, n_layer=2, n_head=8)  # noqa: E731
    s = _strategy(sharding={"stage": 3}, tensor_parallel={"tensor_parallel_degree": 8})
    p = plan(model, s, world, tp_plan=TENSOR_PARALLEL_PLAN)
    b = p.to_dict()["per_rank_bytes"]
    assert p.to_dict()["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": world // 8, "tp": 8}
    # FSDP pads each shard's rows; tiny tensors (norms, biases) pad the most.
    assert 1 <= b["params"] / (4 * p.parameters / world) < 1.6
    assert b["optimizer"] == pytest.approx(2 * b["params"], rel=0.01)


def test_pipeline_bubble_and_batch_arithmetic():
    model = lambda: CharTransformer(96, 16, d_model=64, n_layer=8, n_head=2)  # noqa: E731
    s = _strategy(pipeline={"pp_degree": 8, "accumulate_steps": 32})
    p = plan(model, s, 1024, example=lambda b: (torch.zeros(b, 16, dtype=torch.long),) * 2)
    d = p.to_dict()
    assert p.bubble == pytest.approx(7 / 39)
    assert d["batch"] == {"global": 1 * 32 * 128, "micro": 1, "accumulation": 32,
                          "data": 128}
    assert [r.stages for r in p.ranks] == [[s] for s in range(8)]
    assert [r.in_flight for r in p.ranks] == [8, 7, 6, 5, 4, 3, 2, 1]  # 1F1B's warmup
    # A middle stage sends its output forward and its input's gradient back, per micro-batch.
    hidden = 1 * 16 * 64 * 4
    assert p.ranks[3].comm.bytes["point_to_point"]["pp"] == 2 * 32 * hidden


@pytest.mark.parametrize("sets, message", [
    ({"tensor_parallel": {"tensor_parallel_degree": 8}, "pipeline": {"pp_degree": 8}},
     "does not divide the world size 1000"),
    ({"pipeline": {"pp_degree": 8, "accumulate_steps": 4}}, "fewer than the 8 stages"),
])
def test_layouts_prepare_refuses_are_refused(sets, message):
    model = lambda: CharTransformer(96, 16, d_model=64, n_layer=8, n_head=2)  # noqa: E731
    with pytest.raises(ConfigError, match=message):
        plan(model, _strategy(**sets), 1000, tp_plan=TENSOR_PARALLEL_PLAN)
    assert not dist.is_initialized()


def test_activations_are_what_backward_keeps():
    model = lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))  # noqa: E731
    p = plan(model, _strategy(batch={"micro_batch_size": 5}), 1,
             example=lambda b: (torch.zeros(b, 32), torch.zeros(b, 8)))
    # The first Linear keeps its input, ReLU its output (which the second Linear keeps too).
    assert p.ranks[0].activations == 5 * 32 * 4 + 5 * 64 * 4


def test_attention_is_counted_as_a_fused_kernel():
    def act(seq: int) -> int:
        model = lambda: CharTransformer(96, seq, d_model=64, n_layer=2, n_head=4)  # noqa: E731
        p = plan(model, _strategy(), 1,
                 example=lambda b: (torch.zeros(b, seq, dtype=torch.long),) * 2)
        return p.ranks[0].activations

    # No t x t attention matrix: activations grow linearly with the sequence.
    assert act(256) == pytest.approx(4 * act(64), rel=0.02)


def test_amp_follows_autocasts_casts():
    model = lambda: CharTransformer(96, 32, d_model=64, n_layer=2, n_head=4)  # noqa: E731
    ex = lambda b: (torch.zeros(b, 32, dtype=torch.long),) * 2  # noqa: E731
    batch = {"micro_batch_size": 64}  # activations well above autocast's weight copies
    full = plan(model, _strategy(batch=batch), 1, example=ex).ranks[0].activations
    half = plan(model, _strategy(batch=batch, amp={"dtype": "bfloat16"}), 1,
                example=ex).ranks[0].activations
    # Matrix products keep bf16 inputs; the residual stream, norms and the loss stay fp32.
    assert 0.5 * full < half < 0.9 * full


def test_fsdp_gathers_follow_the_schedule():
    assert fsdp_gathers(3, "FB" * 2, keep_after_backward=False) == 4
    assert fsdp_gathers(2, "FB" * 2, keep_after_backward=False) == 2
    # 1F1B on the first of two stages: F F B B; the first backward gathers and keeps.
    assert schedule_order("1F1B", 2, 0, 2) == "FFBB"
    assert fsdp_gathers(3, "FFBB", keep_after_backward=True) == 3
    assert schedule_order("1F1B", 3, 1, 2) == "FBFBFB"
    assert schedule_order("GPipe", 2, 1, 2) == "FFBB"


def test_counting_restores_torch_distributed():
    before = (dist.all_reduce, dist.isend, dist.distributed_c10d.isend)
    count = CommCount()
    with counting(count, {}):
        assert dist.all_reduce is not before[0]
    assert (dist.all_reduce, dist.isend, dist.distributed_c10d.isend) == before
    count.add("all_reduce", "dp", 100, 4)
    count.add("all_gather", "tp", 100, 1)  # a group of one moves nothing
    assert count.to_dict() == {"all_reduce": {"dp": 100}}
    assert wire_bytes(count) == 150  # 2 (n-1)/n of the buffer


def test_public_api():
    assert bigbatch.plan is plan
    assert "plan" in bigbatch.__all__


def test_user_model_with_loss_and_memory_check():
    model = lambda: CharTransformer(96, 16, d_model=64, n_layer=2, n_head=2)  # noqa: E731

    def loss(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")

    p = plan(model, _strategy(sharding={"stage": 3}), 4, gpu_memory=1e-4, loss=loss,
             example=lambda b: (torch.zeros(b, 16, dtype=torch.long),) * 2)
    assert p.fits is False
    assert "NO" in p.summary() and "dp_shard" in p.summary()


# -- through the real CLI ------------------------------------------------------------------

CHARLM = ["plan", "--task", "charlm", "--task-opt", "d_model=64", "--task-opt", "n_layer=8",
          "--task-opt", "n_head=8"]


def test_cli_json(tmp_path):
    p = run_cli([*CHARLM, "--world", "1024", "--set", "sharding.stage=3",
                 "--set", "tensor_parallel.tensor_parallel_degree=8", "--json"], tmp_path)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for key in ("world", "mesh", "per_rank_bytes", "comm_bytes_per_step", "bubble", "batch"):
        assert key in d
    assert set(d["per_rank_bytes"]) >= {"params", "grads", "optimizer", "activations"}
    assert d["world"] == 1024 and d["mesh"]["tp"] == 8 and d["mesh"]["dp_shard"] == 128
    assert d["optimizer"] == "LAMB"
    assert set(d["comm_bytes_per_step"]) >= {"all_gather", "reduce_scatter", "all_reduce"}
    assert d["comm_bytes_per_step"]["all_reduce"]["tp"] > 0


@pytest.mark.parametrize("args, message", [
    (["--world", "1000", "--set", "tensor_parallel.tensor_parallel_degree=8",
      "--set", "pipeline.pp_degree=8"], "= 64 does not divide the world size 1000"),
    (["--world", "64", "--set", "tensor_parallel.tensor_parallel_degree=16"],
     "n_head=8 is not divisible by tensor_parallel_degree=16"),
    (["--world", "64", "--set", "pipeline.pp_degree=8", "--set", "pipeline.accumulate_steps=4"],
     "fewer than the 8 stages"),
])
def test_cli_refuses_in_one_line(args, message, capsys):
    """`bigbatch plan`'s main() in this process (test_cli_json starts the real command; a
    subprocess each would cost ~4 s of start-up on 2 shared cores and test nothing more)."""
    from bigbatch.cli.main import main

    code = main([*CHARLM, *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = [line for line in err.splitlines() if "Warning" not in line]
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.slow  # plans every candidate layout (~18 s)
def test_cli_suggest_lists_fitting_layouts(tmp_path):
    p = run_cli([*CHARLM, "--world", "4", "--gpu-memory", "0.008", "--suggest"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "layouts that fit 0.008 GiB, fastest first" in p.stdout
    rows = p.stdout.split("fastest first")[1].splitlines()[2:]
    assert rows and "none" not in rows[0]


def _x(b: int) -> torch.Tensor:
    return torch.zeros(b, WIDTH, device="meta")


BAD_EXAMPLES = [
    ("a_tensor", _x(2), "got a Tensor"),
    ("one_tensor", lambda b: _x(b), "example(2) returned a Tensor"),
    ("three", lambda b: (_x(b),) * 3, "example(2) returned a tuple of 3"),
    ("fixed_batch", lambda b: (_x(1), _x(1)), "inputs have shape (1, 1024), not 2 x ..."),
    ("targets_not_tensor", lambda b: (_x(b), [0] * b), "targets is a list"),
    ("raises", lambda: (_x(1),) * 2, "example(2) raised TypeError"),
]


@pytest.mark.parametrize("example, message", [c[1:] for c in BAD_EXAMPLES],
                         ids=[c[0] for c in BAD_EXAMPLES])
def test_a_wrong_example_is_one_line_naming_the_contract(example, message):
    with pytest.raises(ConfigError) as info:
        plan(_square, _strategy(), 2, example=example)
    text = str(info.value)
    assert text.startswith("plan(example=...): ") and message in text, text
    assert "\n" not in text and "returning (inputs, targets)" in text


def test_a_right_example_on_meta_is_measured():
    p = plan(_square, _strategy(), 2, example=lambda b: (_x(b), _x(b)))
    assert p.ranks[0].activations
