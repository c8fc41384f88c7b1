"""ZeRO sharding on 2 gloo ranks == one process on the same global batch.

Stages 1 (ZeroRedundancyOptimizer over DDP), 2 and 3 (FSDP2), with LAMB and LARS,
gradient merge k=2, 10 steps, float32: the weights equal the single-process run
to 1e-5. All scenarios share one spawn of two processes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn

from bigbatch.config.parallelism import degrees
from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World

W, STEPS, K, GLOBAL = 2, 10, 2, 32
# "3o": stage 3 with CPU offload; "3r": stage 3 with recompute of every block.
CASES = [(opt, stage) for opt in ("lamb", "lars") for stage in (1, 2, 3)] + [
    ("lamb", "3o"), ("lamb", "3r")]


class Blocks(nn.Module):
    """A root with its own parameters around a Sequential of blocks (FSDP2's units)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 24), nn.GELU())
                                      for _ in range(3)))
        self.out = nn.Linear(24, 5)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Blocks()


def make_strategy(opt: str, stage: int | str | None) -> Strategy:
    d: dict = {
        "batch": {"global_batch_size": GLOBAL, "base_batch_size": 16, "base_lr": 0.01,
                  "scaling": "sqrt", "warmup_steps": 2, "decay": "cosine"},
        "gradient_merge": {"k_steps": K},
    }
    if opt == "lamb":
        d["optimizer"] = {"type": "adamw", "weight_decay": 0.0}
        d["lamb"] = {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ["bias", "0.weight"]}
    else:
        d["optimizer"] = {"type": "momentum", "momentum": 0.9, "weight_decay": 0.0}
        d["lars"] = {"lars_weight_decay": 1e-4, "exclude_from_weight_decay": ["bias"]}
    if stage is not None:
        d["sharding"] = {"stage": int(str(stage)[0]), "offload": stage == "3o"}
    if stage == "3r":
        d["recompute"] = {"checkpoints": ["blocks.0", "blocks.1", "blocks.2"]}
    return Strategy.from_dict(d)


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, GLOBAL, 12, generator=g), torch.randint(0, 5, (STEPS, GLOBAL),
                                                                      generator=g)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def train(run, rank: int, world: int):
    x, y = data()
    micro = GLOBAL // (K * world)
    for step in range(STEPS):
        for j in range(K):
            rows = slice((j * world + rank) * micro, (j * world + rank + 1) * micro)
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[step, rows]), y[step, rows]))
        assert ms.stepped
    return full_state(run.module)


def _worker() -> dict:
    rank = int(os.environ["RANK"])
    out = {}
    for opt, stage in CASES:
        run = prepare(make_model(), make_strategy(opt, stage), total_steps=STEPS)
        kind = type(run.optimizer).__name__
        out[(opt, stage)] = (train(run, rank, W), kind, type(next(run.module.parameters())).__name__)
    for dtype in ("float16", "bfloat16"):  # mixed precision trains under stage 3
        s = make_strategy("lamb", 3).with_overrides([f"amp.dtype={dtype}"])
        run = prepare(make_model(), s, total_steps=STEPS)
        out[dtype] = (train(run, rank, W), run.step, run.skipped_steps)
    out["overflow"] = _one_rank_overflows(rank)
    return out


def _one_rank_overflows(rank: int) -> bool:
    """The sharded loss scaler: an inf in rank 0's shard alone skips the step on all ranks."""
    from bigbatch.engine.amp import LossScaler

    w = torch.nn.Parameter(torch.ones(4))
    w.grad = torch.full((4,), float("inf") if rank == 0 else 1.0)
    scaler = LossScaler("cpu", init_scale=1.0, sharded=True)
    scaler.scale(torch.ones(()))  # GradScaler unscales only after a scale
    return bool(scaler.unscale_(torch.optim.SGD([w], lr=0.1)))


@pytest.fixture(scope="module")
def sharded():
    return run_workers(_worker, world_size=W, timeout=240, init_group=True)


@pytest.fixture(scope="module")
def single():
    one = World()
    out = {}
    for opt in ("lamb", "lars"):
        run = prepare(make_model(), make_strategy(opt, None), total_steps=STEPS, world=one)
        out[opt] = train(run, 0, 1)
    for dtype in ("float16", "bfloat16"):
        s = make_strategy("lamb", None).with_overrides([f"amp.dtype={dtype}"])
        run = prepare(make_model(), s, total_steps=STEPS, world=one)
        out[dtype] = (train(run, 0, 1), run.step, run.skipped_steps)
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{o}-stage{s}" for o, s in CASES])
def test_zero_stage_equals_single_process(sharded, single, case):
    opt, stage = case
    for rank in range(W):
        weights, kind, param_type = sharded[rank][case]
        assert kind == ("ZeroRedundancyOptimizer" if stage == 1 else opt.upper())
        assert param_type == ("Parameter" if stage == 1 else "DTensor")
        assert weights.keys() == single[opt].keys()
        for name, w in weights.items():
            torch.testing.assert_close(w, single[opt][name], rtol=1e-5, atol=1e-6, msg=name)


def _distance(a: dict, b: dict) -> float:
    return sum((a[k] - b[k]).square().sum() for k in a).sqrt().item()


def test_mixed_precision_under_stage3_trains_like_one_process(sharded, single):
    """fp16 (autocast + the sharded loss scaler) and bf16 (FSDP2's mixed-precision policy):
    the same overflow skips as one process, and weights within low precision's rounding."""
    for dtype in ("float16", "bfloat16"):
        want, steps, skipped = single[dtype]
        noise = _distance(want, single["lamb"])  # how far this precision moves one process
        for rank in range(W):
            weights = sharded[rank][dtype][0]
            assert sharded[rank][dtype][1:] == (steps, skipped)
            if dtype == "float16":  # autocast, as one process: rounding differs only in sums
                for name, w in weights.items():
                    torch.testing.assert_close(w, want[name], rtol=1e-3, atol=2e-4, msg=name)
            else:  # bf16 parameters in compute (norms too): within bf16's own distance
                assert _distance(weights, want) < 2 * noise, (_distance(weights, want), noise)
    assert [sharded[r]["overflow"] for r in range(W)] == [True, True]


def test_sharding_degrees_are_checked_before_launch():
    s = Strategy.from_dict({"sharding": {"stage": 3, "sharding_degree": 3}})
    with pytest.raises(ConfigError, match="sharding_degree=3 does not divide"):
        degrees(s, 4)
    hsdp = degrees(Strategy.from_dict({"sharding": {"stage": 2, "sharding_degree": 2}}), 8)
    assert (hsdp.replicate, hsdp.shard, hsdp.stage) == (4, 2, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_degree=3 = 3 does not divide"):
        degrees(Strategy.from_dict({"tensor_parallel": {"tensor_parallel_degree": 3}}), 4)


@pytest.mark.parametrize("body, match", [
    ({"sharding": {"stage": 2}, "data_parallel": {"reduce": "adasum"}}, "Adasum combines"),
    ({"sharding": {"stage": 3}, "adaptive": {"noise_scale": True}}, "noise scale"),
    ({"sharding": {"stage": 1}, "tensor_parallel": {"tensor_parallel_degree": 2}}, "stage=1"),
    ({"sharding": {"stage": 1, "offload": True}}, "offload"),
    ({"sharding": {"stage": 4}}, "sharding.stage"),
])
def test_bad_sharding_combinations_name_the_keys(body, match):
    with pytest.raises(ConfigError, match=match):
        Strategy.from_dict(body)


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "3", "--set", "sharding.sharding_degree=2"],
     "sharding.sharding_degree=2 does not divide the data-parallel degree 3"),
    (["--nproc", "2", "--set", "tensor_parallel.tensor_parallel_degree=2"],
     "task 'mnist1d' has no tensor-parallel plan"),
    (["--task", "charlm", "--task-opt", "n_head=3", "--task-opt", "d_model=96", "--nproc", "2",
      "--set", "tensor_parallel.tensor_parallel_degree=2"],
     "n_head=3 is not divisible by tensor_parallel_degree=2"),
    (["--nproc", "4", "--set", "tensor_parallel.tensor_parallel_degree=2",
      "--set", "sharding.stage=1"], "does not combine with tensor_parallel_degree > 1"),
    (["--nproc", "2", "--set", "sharding.stage=2", "--set", "data_parallel.reduce=adasum"],
     "Adasum combines whole per-worker gradients"),
])
def test_cli_refuses_bad_mesh_before_launch(argv, message, tmp_path, capsys):
    from bigbatch.cli.main import main

    out = tmp_path / "out"
    code = main(["train", "--out", str(out), "--steps", "2", "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()
