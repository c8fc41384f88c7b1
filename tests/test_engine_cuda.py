"""The engine's step on CUDA makes no host sync (marked ``cuda``; skipped without a GPU).

After a first step (optimizer state is created there), every micro-step and
optimizer step runs under ``torch.cuda.set_sync_debug_mode("error")``: AdamW,
LAMB, LARS, global-norm clipping, bf16 autocast, gradient merge, summed losses
with a tensor count, the noise scale (its norms stay on the device until the
batched transfer every 64 steps, or a read of `run.stats`), and fp16 loss scaling
(the optimizer skips an overflow step on the device: `Run.device_skip`), Fleet's AMP
op lists and Muon. Under fp16 the listed ops compute in their listed dtype on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.parallel.world import World

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


CASES = {
    "adamw_clip": {"optimizer": {"type": "adamw", "weight_decay": 0.01, "max_grad_norm": 1.0}},
    "lamb_clip_bf16": {"optimizer": {"type": "adamw", "max_grad_norm": 1.0}, "lamb": {"enable": True},
                       "amp": {"enable": True, "dtype": "bfloat16"}},
    "lars_merge": {"optimizer": {"type": "momentum", "momentum": 0.9},
                   "lars": {"enable": True}, "gradient_merge": {"k_steps": 2}},
    "adamw_noise_scale": {"optimizer": {"type": "adamw"}, "gradient_merge": {"k_steps": 2},
                          "adaptive": {"noise_scale": True}},
    "adamw_fp16_clip": {"optimizer": {"type": "adamw", "max_grad_norm": 1.0},
                        "amp": {"enable": True, "dtype": "float16"}},
    "lamb_fp16_merge": {"optimizer": {"type": "adamw", "max_grad_norm": 1.0},
                        "lamb": {"enable": True}, "gradient_merge": {"k_steps": 2},
                        "amp": {"enable": True, "dtype": "float16"}},
    "lars_fp16": {"optimizer": {"type": "momentum", "momentum": 0.9}, "lars": {"enable": True},
                  "amp": {"enable": True, "dtype": "float16"}},
    # Fleet's AMP op lists (a TorchFunctionMode around autocast) under loss scaling
    "adamw_fp16_op_lists": {"optimizer": {"type": "adamw"}, "amp": {
        "enable": True, "dtype": "float16", "custom_black_list": ["layer_norm", "softmax"],
        "custom_white_list": ["gelu"]}},
    "muon_bf16_merge": {"optimizer": {"type": "adamw"}, "muon": {"enable": True},
                        "gradient_merge": {"k_steps": 2}, "amp": {"enable": True,
                                                                 "dtype": "bfloat16"}},
    "muon_fp16": {"optimizer": {"type": "adamw"}, "muon": {"enable": True},
                  "amp": {"enable": True, "dtype": "float16"}},
}


def _strategy(sections: dict) -> Strategy:
    d = {"batch": {"global_batch_size": 16, "base_batch_size": 16, "base_lr": 1e-3,
                   "warmup_steps": 2, "decay": "cosine"}}
    for name, body in sections.items():
        d.setdefault(name, {}).update(body)
    return Strategy.from_dict(d)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("count", [False, True], ids=["mean", "count"])
def test_engine_step_makes_no_host_sync(name, count):
    torch.manual_seed(0)
    model = Tiny()
    # The default nan_policy reads one flag per step where gradient hooks run (the noise
    # scale): a skipped step must not reach them (`Run.nan_check_on_device`).
    policy = None if "noise_scale" in name else "stop"
    run = prepare(model, _strategy(CASES[name]), total_steps=20,
                  world=World(device=torch.device("cuda")), nan_policy=policy)
    tokens = torch.randint(0, 64, (12, run.plan.micro_batch_size, 9), device="cuda")

    def micro(i):
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        with run.micro_step() as ms:
            logits = run.model(x).float()
            if count:
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
                ms.backward(loss, count=(y >= 0).sum())
            else:
                ms.backward(F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        return ms

    for i in range(run.k_steps):  # the first step creates the optimizer's state
        micro(i)
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stepped = 0
        for i in range(run.k_steps, 12):
            stepped += micro(i).stepped
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert stepped == (12 - run.k_steps) // run.k_steps and run.step == stepped + 1
    moved = [not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(),
                                                              strict=True)]
    assert all(moved)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["adamw_fp16_clip", "lamb_fp16_merge", "lars_fp16"])
def test_fp16_overflow_is_skipped_on_the_device(name):
    """An inf loss: the optimizer leaves the weights as they were, the step counts as
    skipped, the schedule moves on, and nothing is read to the host."""
    torch.manual_seed(0)
    model = Tiny()
    run = prepare(model, _strategy(CASES[name]), total_steps=20,
                  world=World(device=torch.device("cuda")))
    assert run.device_skip
    tokens = torch.randint(0, 64, (run.k_steps, run.plan.micro_batch_size, 9), device="cuda")
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(run.k_steps):
            with run.micro_step() as ms:
                loss = F.cross_entropy(run.model(tokens[i, :, :-1]).float().flatten(0, 1),
                                       tokens[i, :, 1:].flatten())
                ms.backward(loss * float("inf"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ms.stepped and run.step == 1 and run.skipped_steps == 1
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("name", ["lars_merge", "adamw_clip", "lamb_clip_bf16"])
def test_a_nan_loss_is_skipped_on_the_device_and_named_later(name):
    """nan_policy on CUDA: the optimizer skips the step on the GPU, no host sync inside
    the step; `stop` raises once the flag is looked at (`run.stats` waits for it)."""
    from bigbatch.errors import NonFiniteLossError

    torch.manual_seed(0)
    model = Tiny()
    run = prepare(model, _strategy(CASES[name]), total_steps=20,
                  world=World(device=torch.device("cuda")))
    assert run.nan_check_on_device
    tokens = torch.randint(0, 64, (8, run.plan.micro_batch_size, 9), device="cuda")

    def step(i, bad=False):
        for j in range(run.k_steps):
            x, y = tokens[i * run.k_steps + j, :, :-1], tokens[i * run.k_steps + j, :, 1:]
            with run.micro_step() as ms:
                loss = F.cross_entropy(run.model(x).float().flatten(0, 1), y.flatten())
                ms.backward(loss * float("nan") if bad and j == 0 else loss)

    step(0)
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(1, bad=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, p.detach())
    with pytest.raises(NonFiniteLossError, match="non-finite loss at optimizer step 2 "):
        _ = run.stats


def test_fleet_op_lists_set_each_listed_ops_dtype_on_cuda():
    """fp16 autocast on CUDA: a black-listed op runs in float32, a white-listed one in
    float16, the rest as autocast decides (linear: float16, layer_norm: float32)."""
    torch.manual_seed(0)
    net = Tiny().cuda()
    strategy = _strategy({"optimizer": {"type": "adamw"}, "amp": {
        "enable": True, "dtype": "float16", "custom_black_list": ["linear"],
        "custom_white_list": ["layer_norm"]}})
    run = prepare(net, strategy, total_steps=2, world=World(device=torch.device("cuda")))
    seen = {}
    for name, mod in (("up", net.layers[0].up), ("norm", net.layers[0].norm),
                      ("head", net.head)):
        mod.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    x = torch.randint(0, 64, (16, 8), device="cuda")
    with run.micro_step() as ms:
        out = run.model(x)
        ms.backward(F.cross_entropy(out.float().flatten(0, 1), x.flatten()))
    assert seen == {"up": torch.float32, "norm": torch.float16, "head": torch.float32}
