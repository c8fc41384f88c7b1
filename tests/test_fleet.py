"""`--fleet`: the seed guide's three example strategies (examples/fleet/) train as Fleet.

Each example is translated (`bigbatch.config.fleet.translate`) and trained 20 steps by the
engine; a hand-written reference takes the same steps with the guide's equations written
out literally (LARS's local LR and velocity, LAMB's moments and trust ratio without bias
correction, Momentum's velocity, a merge of k_steps micro-batch gradients averaged, a
constant LR). Weights agree to 1e-6 relative in float64 on one process and on 2 gloo
ranks (one start of two processes for all three examples).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn

from bigbatch.config.fleet import translate
from bigbatch.engine.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {name: ROOT / "examples" / "fleet" / f"{name}.toml"
            for name in ("train_fleet_lars", "train_fleet_lamb", "train_fleet_gradient_merge")}
STEPS, TOLERANCE = 20, 1e-6


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def data(global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, global_batch, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (STEPS, global_batch), generator=g)


def fleet_file(name: str) -> dict:
    return tomllib.loads(EXAMPLES[name].read_text())


def engine(name: str, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    """The Fleet-faithful run: the translated strategy through `prepare`, 20 steps."""
    strategy = translate(EXAMPLES[name]).build()
    plan = strategy.resolve(world_size)
    net = model()
    run = prepare(net, strategy, total_steps=STEPS, nan_policy=None)
    x, y = data(plan.global_batch_size)
    m, k = plan.micro_batch_size, plan.k_steps
    for step in range(STEPS):
        for j in range(k):
            start = (j * world_size + rank) * m
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[step, start:start + m]),
                                            y[step, start:start + m]))
        assert ms.stepped
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def reference(name: str, world_size: int) -> dict[str, torch.Tensor]:
    """The guide's equations, literally, on the whole global batch of every step."""
    f = fleet_file(name)
    opt = f["optimizer"]
    lr, k = opt["learning_rate"], f.get("gradient_merge_configs", {}).get("k_steps", 1)
    per_card = f["batch_size"]
    net = model()
    params = dict(net.named_parameters())
    x, y = data(per_card * k * world_size)
    state = {n: {} for n in params}
    for step in range(STEPS):
        grads = {n: torch.zeros_like(p) for n, p in params.items()}
        for j in range(k):  # gradient merge: k micro-batches of the global batch, averaged
            rows = slice(j * per_card * world_size, (j + 1) * per_card * world_size)
            net.zero_grad()
            F.cross_entropy(net(x[step, rows]), y[step, rows]).backward()
            for n, p in params.items():
                grads[n] += p.grad / k
        with torch.no_grad():
            for n, p in params.items():
                if f.get("lars"):
                    _lars(p, grads[n], state[n], lr, opt["momentum"], f["lars_configs"], n)
                elif f.get("lamb"):
                    _lamb(p, grads[n], state[n], lr, opt, f["lamb_configs"], n)
                else:  # paddle.optimizer.Momentum: v = mu v + g; w = w - lr v
                    v = state[n]["v"] = opt["momentum"] * state[n].get("v", 0) + grads[n]
                    p.sub_(lr * v)
    return {n: p.detach().clone() for n, p in params.items()}


def _lars(w, g, s, lr, mu, c, name) -> None:
    """local_lr = lr * coeff * |w| / (|g| + wd |w|); v = mu v + local_lr (g + wd w + eps);
    w = w - v. Excluded (substring) tensors have wd = 0, and with wd = 0 Fleet's
    lars_momentum keeps the global LR (plain momentum)."""
    wd = 0.0 if any(p in name for p in c["exclude_from_weight_decay"]) else c["lars_weight_decay"]
    local_lr = lr * c["lars_coeff"] * w.norm() / (g.norm() + wd * w.norm()) if wd > 0 else lr
    s["v"] = mu * s.get("v", 0) + local_lr * (g + wd * w + c["epsilon"])
    w.sub_(s["v"])


def _lamb(w, g, s, lr, opt, c, name) -> None:
    """m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; r = m / (sqrt(v) + eps);
    w = w - lr |w| / |r + wd w| (r + wd w). Excluded (name suffix) tensors have wd = 0
    and keep the trust ratio; where a norm is 0 (a zero bias) the ratio is 1, as in
    Paddle's lamb kernel (the equation alone would keep such a tensor at 0)."""
    b1, b2, eps = opt["beta1"], opt["beta2"], opt["epsilon"]
    wd = 0.0 if any(name.endswith(p) for p in c["exclude_from_weight_decay"]) \
        else c["lamb_weight_decay"]
    s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
    s["v"] = b2 * s.get("v", 0) + (1 - b2) * g * g
    u = s["m"] / (s["v"].sqrt() + eps) + wd * w
    ratio = w.norm() / u.norm() if w.norm() > 0 and u.norm() > 0 else 1.0
    w.sub_(lr * ratio * u)


def worst(got: dict, want: dict) -> float:
    return max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-12))
               for n in want)


def _worker() -> dict:
    import torch.distributed as dist

    return {name: engine(name, 2, dist.get_rank()) for name in EXAMPLES}


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(_worker, world_size=2, timeout=120, init_group=True)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_one_process_equals_fleet_equations(name):
    want = reference(name, 1)
    got = engine(name, 1, 0)
    assert worst(got, want) < TOLERANCE
    start = {n: p.detach() for n, p in model().named_parameters()}
    assert worst(start, want) > 1e-3  # the run moved the weights


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_two_gloo_ranks_equal_fleet_equations(two_ranks, name):
    want = reference(name, 2)
    for rank in range(2):
        assert worst(two_ranks[rank][name], want) < TOLERANCE
