"""`data_parallel.find_unused_parameters` under ZeRO stage 2-3 (FSDP2), on 2 gloo ranks.

FSDP2 (torch 2.13's `FSDPModule.set_reduce_scatter_unused_params`) reduce-scatters a
zero gradient for a parameter that a rank's backward did not reach, as DDP's pass does.
A model written as users write them (an embedding, nested blocks whose mixer has an
optional gate, a final norm, an untied head) where rank 1 leaves the last block's gate
out of some micro-steps (a whole step inside the first-steps check, and one micro-step
of a later one): ZeRO-2 and ZeRO-3 train 5 steps to the weights DDP with
find_unused_parameters reaches on the same data, and to a single process that averages
the ranks' gradients with zeros for the gate rank 1 skipped. A whole block one rank
skips still breaks FSDP2's gathers: it is named in one line that says what to do, and
what the line says (0 * the block's output on that rank) trains.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn

from bigbatch.config.strategy import Strategy
from bigbatch.engine.optimizer import build_optimizer
from bigbatch.engine.prepare import prepare
from bigbatch.parallel.data_parallel import UnusedParametersError
from bigbatch.parallel.sharding import fsdp_reduces_unused

pytestmark = pytest.mark.skipif(
    not fsdp_reduces_unused(),
    reason="torch without FSDP2's unused-parameter pass (its refusal: test_failure_lines)")

W, K, STEPS, MICRO, SEQ, VOCAB, D, CLASSES = 2, 2, 5, 4, 6, 32, 16, 5
GLOBAL = W * K * MICRO
LR = 0.01
SKIPPED = {(1, 0), (1, 1), (3, 1)}
"""(optimizer step, micro-step) where rank 1 leaves the gate of layers.1 out."""


class Mixer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)
        self.proj_out = nn.Linear(d, d)

    def forward(self, h, gated=True):
        y = self.proj_in(h)
        if gated:
            y = y * torch.sigmoid(self.gate(h))
        return self.proj_out(torch.tanh(y))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        return self.fc2(F.gelu(self.fc1(h)))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.mixer = nn.LayerNorm(d), Mixer(d)
        self.norm2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, h, gated=True):
        h = h + self.mixer(self.norm1(h), gated)
        return h + self.mlp(self.norm2(h))


class Net(nn.Module):
    """`gated=False` leaves the last block's gate out; `skip` names a block not run, and
    `zeroed` one whose output is added times 0 (it runs, its gradients are zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(D) for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES, bias=False)

    def forward(self, tokens, gated=True, skip=None, zeroed=None):
        h = self.embed(tokens)
        for i, block in enumerate(self.layers):
            if i == skip:
                continue
            out = block(h, gated or i < len(self.layers) - 1)
            h = h + 0 * out if i == zeroed else out
        return self.head(self.norm(h).mean(1))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def make_strategy(stage: int | None) -> Strategy:
    d: dict = {"batch": {"global_batch_size": GLOBAL, "micro_batch_size": MICRO,
                         "base_batch_size": GLOBAL, "base_lr": LR, "warmup_steps": 0,
                         "decay": "none"},
               "optimizer": {"type": "adamw", "weight_decay": 0.01},
               "gradient_merge": {"k_steps": K},
               "data_parallel": {"find_unused_parameters": True}}
    if stage is not None:
        d["sharding"] = {"stage": stage}
    return Strategy.from_dict(d)


def data():
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, VOCAB, (STEPS, GLOBAL, SEQ), generator=g),
            torch.randint(0, CLASSES, (STEPS, GLOBAL), generator=g))


def rows(rank: int, micro: int) -> slice:
    start = (micro * W + rank) * MICRO
    return slice(start, start + MICRO)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _train(stage: int | None, rank: int):
    """5 steps on this rank's rows; (weights, the LR of each step)."""
    x, y = data()
    run = prepare(make_model(), make_strategy(stage), total_steps=STEPS)
    lrs = []
    for step in range(STEPS):
        lrs.append(run.optimizer.param_groups[0]["lr"])
        for j in range(K):
            gated = rank != 1 or (step, j) not in SKIPPED
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[step, rows(rank, j)], gated),
                                            y[step, rows(rank, j)]))
        assert ms.stepped
    return full_state(run.module), lrs


def _whole_block(stage: int, rank: int, how: str):
    """Rank 1 skips layers.0 (`how` = "skip") or adds 0 * its output ("zeroed"):
    (the error's line or None, steps taken)."""
    x, y = data()
    run = prepare(make_model(), make_strategy(stage), total_steps=STEPS)
    try:
        for step in range(STEPS):
            for j in range(K):
                mine = {how: 0} if rank == 1 else {}
                with run.micro_step() as ms:
                    ms.backward(F.cross_entropy(run.model(x[step, rows(rank, j)], **mine),
                                                y[step, rows(rank, j)]))
    except UnusedParametersError as e:
        return str(e), run.step
    return None, run.step


def _worker():
    rank = int(os.environ["RANK"])
    out = {f"zero{stage}": _train(stage, rank) for stage in (2, 3)}
    out["ddp"] = _train(None, rank)
    for stage in (2, 3):
        for how in ("skip", "zeroed"):
            out[(stage, how)] = _whole_block(stage, rank, how)
    return out


def reference(skipped=SKIPPED) -> dict[str, torch.Tensor]:
    """One process: each step's gradient is the mean of the ranks' gradients (each the
    mean over its micro-steps), a gate rank 1 left out counting as zeros; AdamW as
    bigbatch builds it, at the constant LR."""
    x, y = data()
    model = make_model()
    opt = build_optimizer(model, make_strategy(None), lr=LR)
    params = dict(model.named_parameters())
    for step in range(STEPS):
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        for rank in range(W):
            model.zero_grad(set_to_none=True)
            for j in range(K):
                gated = rank != 1 or (step, j) not in skipped
                loss = F.cross_entropy(model(x[step, rows(rank, j)], gated),
                                       y[step, rows(rank, j)])
                (loss / K).backward()
            for n, p in params.items():
                if p.grad is not None:
                    total[n] += p.grad
        for n, p in params.items():
            p.grad = total[n] / W
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def relative(a: dict, b: dict) -> float:
    """The largest max|a - b| / max|b| over the tensors."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


@pytest.fixture(scope="module")
def trained():
    return run_workers(_worker, W, timeout=120)


def test_zero2_and_zero3_equal_ddp_and_one_process_averaging_zeros(trained):
    want = reference()
    # The skipped gate matters: every rank using it ends far from this.
    assert relative(reference(skipped=set()), want) > 1e-3
    worst = {}
    for rank in range(W):
        ddp, lrs = trained[rank]["ddp"]
        assert lrs == [LR] * STEPS  # the reference's constant LR
        worst[f"ddp-vs-one-process rank {rank}"] = relative(ddp, want)
        for stage in (2, 3):
            weights, stage_lrs = trained[rank][f"zero{stage}"]
            assert stage_lrs == lrs
            worst[f"zero{stage}-vs-ddp rank {rank}"] = relative(weights, ddp)
            worst[f"zero{stage}-vs-one-process rank {rank}"] = relative(weights, want)
    print("worst relative differences:", worst)
    assert max(worst.values()) < 1e-6, worst


@pytest.mark.parametrize("stage", [2, 3])
def test_a_whole_block_one_rank_skips_is_still_named(trained, stage):
    lines = {r[(stage, "skip")][0] for r in trained}
    assert len(lines) == 1, lines  # every rank says the same
    line = lines.pop()
    assert line is not None and "\n" not in line
    assert line.startswith("module layers.0 (parameter(s) layers.0.norm1.weight, "), line
    assert "did not run on rank 1 in optimizer step 1 while rank 0 ran it" in line, line
    assert ("(data_parallel.find_unused_parameters covers parameters of a block that ran, "
            "not a block that did not run)") in line, line
    assert line.endswith("run every block on every rank (where a rank does not want one, add "
                         "0 * its output, so that its backward runs too), or (without tensor "
                         "parallelism) sharding.stage = 1 with "
                         "data_parallel.find_unused_parameters = true"), line
    assert all(r[(stage, "skip")][1] == 0 for r in trained)  # before the first update


@pytest.mark.parametrize("stage", [2, 3])
def test_what_the_line_says_trains(trained, stage):
    assert [r[(stage, "zeroed")] for r in trained] == [(None, STEPS)] * W
