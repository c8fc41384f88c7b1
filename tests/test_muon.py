"""Muon against a plain hand-written reference of the published algorithm (Jordan et al.
2024 with Moonlight's update scale and decoupled weight decay), float64, 1e-6; its AdamW
part against torch's AdamW; the batched kernel against the reference; which parameters
go where; one-line errors; the work balance of the owner assignment."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch.optim import Muon, muon, muon_param_groups
from bigbatch.optim.whole_matrices import assign_owners, balance, ns_cost, shard_bounds


def reference_ns(g: torch.Tensor, steps: int, a: float, b: float, c: float,
                 eps: float) -> torch.Tensor:
    """Newton-Schulz as the Muon write-up gives it, one matrix, written out plainly."""
    x = g.clone()
    transposed = False
    if x.shape[0] > x.shape[1]:
        x = x.t()
        transposed = True
    x = x / (x.norm() + eps)
    for _ in range(steps):
        A = x @ x.t()
        B = b * A + c * A @ A
        x = a * x + B @ x
    return x.t() if transposed else x


def reference_step(w, g, buf, lr, momentum, nesterov, wd, steps=5,
                   abc=(3.4445, -4.7750, 2.0315), eps=1e-7, rule="adamw", rms=0.2):
    """Moonlight's Muon step on one matrix (conv weights viewed as out x the rest)."""
    buf = momentum * buf + g
    d = g + momentum * buf if nesterov else buf
    m = d.reshape(d.shape[0], -1)
    o = reference_ns(m, steps, *abc, eps).reshape(d.shape)
    rows, cols = m.shape
    scale = {"adamw": rms * math.sqrt(max(rows, cols)),
             "shape": math.sqrt(max(1, rows / cols)), "none": 1.0}[rule]
    w = w * (1 - lr * wd) - lr * scale * o
    return w, buf


SHAPES = [(8, 5), (5, 8), (6, 6), (4, 3, 2, 2)]


@pytest.mark.parametrize("kernel", ["reference", "batched"])
@pytest.mark.parametrize("nesterov, rule, wd", [(True, "adamw", 0.1), (False, "shape", 0.0),
                                                 (True, "none", 0.01)])
def test_three_steps_equal_the_published_algorithm(kernel, nesterov, rule, wd):
    torch.manual_seed(0)
    ws = [torch.randn(s, dtype=torch.float64) for s in SHAPES + [(8, 5)]]  # two of one shape
    params = [nn.Parameter(w.clone()) for w in ws]
    opt = Muon([{"params": params, "use_muon": True}], lr=0.05, momentum=0.9,
               nesterov=nesterov, weight_decay=wd, scale_rule=rule, kernel=kernel)
    bufs = [torch.zeros_like(w) for w in ws]
    for _ in range(3):
        grads = [torch.randn_like(w) for w in ws]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i in range(len(ws)):
            ws[i], bufs[i] = reference_step(ws[i], grads[i], bufs[i], 0.05, 0.9, nesterov, wd,
                                            rule=rule)
    for p, w in zip(params, ws, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-9)


def test_functional_muon_takes_other_coefficients_and_steps():
    torch.manual_seed(1)
    w, g = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    buf = torch.zeros_like(w)
    got = w.clone()
    muon([got], [g], [buf.clone()], lr=0.1, momentum=0.5, ns_steps=8,
         ns_coefficients=(2.0, -1.5, 0.5), weight_decay=0.0)
    want, _ = reference_step(w, g, buf, 0.1, 0.5, True, 0.0, steps=8, abc=(2.0, -1.5, 0.5))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # the cubic (2, -1.5, 0.5) converges to the polar factor: singular values -> 1
    o = reference_ns(g, 30, 1.5, -0.5, 0.0, 1e-7)
    torch.testing.assert_close(torch.linalg.svdvals(o), torch.ones(4, dtype=torch.float64))


def test_adamw_part_equals_torch_adamw():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(10, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.Linear(6, 3))
    model.double()
    model[2].weight.requires_grad_(False)  # Muon's matrix held still: the rest sees AdamW only
    ref = copy.deepcopy(model)
    groups = muon_param_groups(model, weight_decay=0.1, adamw=("3.",))
    opt = Muon(groups, lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    adam_params = [p for g in groups if not g["use_muon"] for p in g["params"]]
    ref_groups = [{"params": [dict(ref.named_parameters())[n] for n in g["param_names"]],
                   "weight_decay": g["weight_decay"]} for g in groups if not g["use_muon"]]
    ref_opt = torch.optim.AdamW(ref_groups, lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    x = torch.randint(0, 10, (5, 4))
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    names = [n for g in groups if not g["use_muon"] for n in g["param_names"]]
    assert sorted(names) == ["0.weight", "1.bias", "1.weight", "2.bias", "3.bias", "3.weight"]
    for n, p in zip(names, adam_params, strict=True):
        torch.testing.assert_close(p, dict(ref.named_parameters())[n], rtol=1e-6, atol=1e-9)


def test_batched_kernel_equals_reference_and_state_dict_resumes():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 8),
                          nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)).double()
    models = [copy.deepcopy(model) for _ in range(3)]
    opts = [Muon(muon_param_groups(m, 0.1, adamw=("5.",)), lr=0.02, kernel=k)
            for m, k in zip(models, ("reference", "batched", "batched"), strict=True)]
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)

    def step(m, o):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()

    for t in range(4):
        for m, o in zip(models, opts, strict=True):
            step(m, o)
        if t == 1:  # the third resumes from the second's state dict
            models[2] = copy.deepcopy(models[1])
            opts[2] = Muon(muon_param_groups(models[2], 0.1, adamw=("5.",)), lr=0.02,
                           kernel="batched")
            opts[2].load_state_dict(copy.deepcopy(opts[1].state_dict()))
    for a, b, c in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
        assert torch.equal(b, c)


def test_param_groups_send_embeddings_head_norms_and_biases_to_adamw():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(10, 8)  # an embedding whatever its name
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
                                        for _ in range(2))
            self.conv = nn.Conv1d(8, 8, 3)
            self.lm_head = nn.Linear(8, 10, bias=False)

    groups = muon_param_groups(Net(), weight_decay=0.1)
    kinds = {(g["use_muon"], g["weight_decay"]): sorted(g["param_names"]) for g in groups}
    assert kinds == {
        (True, 0.1): ["blocks.0.1.weight", "blocks.1.1.weight", "conv.weight"],
        (False, 0.1): ["lm_head.weight", "tok.weight"],
        (False, 0.0): ["blocks.0.0.bias", "blocks.0.0.weight", "blocks.0.1.bias",
                       "blocks.1.0.bias", "blocks.1.0.weight", "blocks.1.1.bias", "conv.bias"]}
    # named_parameters straight in: the name rule and ndim
    opt = Muon(Net().named_parameters(), lr=0.01)
    assert sum(len(g["params"]) for g in opt.param_groups if g["use_muon"]) == 4  # + tok.weight
    assert bigbatch.Muon is Muon


@pytest.mark.parametrize("kwargs, message", [
    (dict(momentum=1.0), r"Muon: momentum=1.0 is outside the allowed range \[0.0, 1.0\)"),
    (dict(ns_steps=-1), r"Muon: ns_steps=-1 is outside the allowed range \[0, inf\)"),
    (dict(scale_rule="rms"), r"Muon: scale_rule='rms' should be one of \('adamw'"),
    (dict(ns_coefficients=(1.0, 2.0)), r"ns_coefficients=\(1.0, 2.0\) should be three"),
    (dict(kernel="triton"), r"Muon: kernel='triton' should be one of"),
])
def test_bad_arguments_are_one_line_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Muon([nn.Parameter(torch.zeros(2, 2))], **kwargs)
    with pytest.raises(ValueError, match=r"use_muon group holds a tensor of shape \(3,\)"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": True}])


def test_owners_spread_the_work_and_shards_cut_like_torch_chunk():
    shapes = [(64, 64)] * 6 + [(64, 256), (256, 64)] * 4 + [(32, 16)]
    owners, loads = assign_owners([ns_cost(s) for s in shapes], 4)
    assert max(loads) <= 1.2 * (sum(loads) / 4)
    assert balance(shapes, 4) == max(loads) / (sum(loads) / 4)
    assert sorted(set(owners)) == [0, 1, 2, 3]
    for size, n in ((10, 4), (3, 4), (8, 2), (0, 2)):
        cuts = [shard_bounds(size, n, r) for r in range(n)]
        sizes = [e - s for s, e in cuts]
        want = [len(c) for c in torch.arange(size).chunk(n)] if size else []
        assert sizes[: len(want)] == want and sum(sizes) == size


class _Block(nn.Module):
    """A GPT-2 block as users write one: attention and MLP modules inside it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class _GPT2(nn.Module):
    """GPT-2 small's parameters (d 768, 12 blocks, vocabulary 50257), blocks nested in a
    ``transformer`` module, the head untied."""

    def __init__(self, d: int = 768, layers: int = 12, vocab: int = 50257) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte, self.transformer.wpe = nn.Embedding(vocab, d), nn.Embedding(1024, d)
        self.transformer.h = nn.ModuleList(_Block(d) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


@pytest.mark.parametrize("ranks", [2, 4])
def test_newton_schulz_work_of_gpt2_small_over_ddp_replicas_is_balanced(ranks):
    """`Muon.ns_work` as one of `ranks` DDP ranks (torch's fake process group): each
    replica's Newton-Schulz flops, all matrices counted once, no rank above 1.2x the mean;
    with spread_ns=False every rank does all of it."""
    import torch.distributed as dist

    from bigbatch.planner.fake import fake_world

    with torch.device("meta"):
        model = _GPT2()
    groups = muon_param_groups(model, weight_decay=0.1)
    shapes = [p.shape for g in groups if g["use_muon"] for p in g["params"]]
    assert len(shapes) == 48  # the head and embeddings go to AdamW
    whole = sum(2 * 5 * ns_cost(s) for s in shapes)
    with fake_world(0, ranks):
        work = Muon(groups, replicas=dist.group.WORLD).ns_work()
        alone = Muon(groups, replicas=dist.group.WORLD, spread_ns=False).ns_work()
    assert len(work) == ranks and sum(work) == whole and alone == [whole]
    assert max(work) <= 1.2 * whole / ranks
    assert max(work) / (whole / ranks) == balance(shapes, ranks)
    print(f"GPT-2 small over {ranks} DDP ranks: {[round(w / 1e9, 2) for w in work]} GFLOP "
          f"a step, max/mean {balance(shapes, ranks):.3f}")


@pytest.mark.parametrize("body, message", [
    ({"momentum": 1.0}, r"^muon\.momentum must be in \[0, 1\), got 1\.0$"),
    ({"ns_steps": 0}, r"^muon\.ns_steps must be in \[1, 100\], got 0$"),
    ({"scale_rule": "rms"}, r"^muon\.scale_rule must be one of adamw, shape, none; got 'rms'$"),
    ({"ns_coefficients": [1.0, 2.0]}, r"^muon\.ns_coefficients=\[1\.0, 2\.0\] should be three"),
])
def test_bad_muon_keys_are_one_line_naming_key_value_and_range(body, message):
    from bigbatch.config.strategy import Strategy
    from bigbatch.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as e:
        Strategy.from_dict({"optimizer": {"type": "adamw"}, "muon": body})
    assert "\n" not in str(e.value)


def test_strategy_section_builds_muon_with_the_keys():
    from bigbatch.config.strategy import Strategy
    from bigbatch.engine.optimizer import build_optimizer

    s = Strategy.from_toml('[optimizer]\ntype = "adamw"\nbeta2 = 0.95\n[muon]\nmomentum = 0.9\n'
                           'ns_steps = 6\nmuon_weight_decay = 0.05\nadamw_params = ["3."]\n')
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    opt = build_optimizer(model, s, lr=0.01)
    assert isinstance(opt, Muon) and s.optimizer_name() == "Muon"
    muon_group = next(g for g in opt.param_groups if g["use_muon"])
    assert muon_group["param_names"] == ["1.weight"]
    assert (muon_group["momentum"], muon_group["ns_steps"], muon_group["weight_decay"],
            muon_group["betas"]) == (0.9, 6, 0.05, (0.9, 0.95))


def test_empty_group_shares_stay_and_a_meta_step_runs():
    """ZeroRedundancyOptimizer gives a rank empty shares of some groups: the local Muon
    keeps them (its groups must pair with ZeRO's one to one); `bigbatch plan` steps on
    the meta device."""
    w, b = torch.randn(4, 3), torch.randn(4)
    opt = Muon([{"params": [], "use_muon": True}, {"params": [w], "use_muon": True},
                {"params": [b], "use_muon": False}, {"params": []}], lr=0.01)
    assert [len(g["params"]) for g in opt.param_groups] == [0, 1, 1, 0]
    assert [g["use_muon"] for g in opt.param_groups] == [True, True, False, False]
    meta = [torch.empty(4, 3, device="meta", requires_grad=True),
            torch.empty(4, device="meta", requires_grad=True)]
    for p in meta:
        p.grad = torch.empty_like(p)
    on_meta = Muon(meta, lr=0.01)
    on_meta.step()
    assert all(v.device.type == "meta" for s in on_meta.state.values() for v in s.values())


def _flag_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 10))


def _no_host_read(*_):
    pytest.fail("the overflow flag was read to the host")


def _flag_step(kernel: str, flags: list) -> tuple[dict, dict]:
    """Steps of a small net, the optimizer told ``flags[i]`` (None: no flag) at step i,
    with every read of a tensor to a Python number failing the test while a flag is set."""
    net = _flag_net()
    opt = Muon(muon_param_groups(net, 0.1, adamw=("3.",)), lr=0.05, kernel=kernel)
    x = torch.randint(0, 10, (4, 3))
    for flag in flags:
        opt.zero_grad()
        net(x).square().mean().backward()
        if flag is None:
            opt.step()
            continue
        if flag:  # what an overflow leaves in the gradients
            for p in net.parameters():
                p.grad.fill_(float("inf"))
        opt.found_inf = torch.tensor(flag)
        with pytest.MonkeyPatch.context() as mp:
            for name in ("__bool__", "__float__", "item", "tolist"):
                mp.setattr(torch.Tensor, name, _no_host_read)
            opt.step()
        del opt.found_inf
    state = {f"{i}.{k}": v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    return {n: p.detach().clone() for n, p in net.named_parameters()}, state


@pytest.mark.parametrize("kernel", ["reference", "batched"])
def test_overflow_flag_skips_without_a_host_read(kernel):
    """GradScaler's ``found_inf``: 1 leaves weights, momentum, AdamW moments and step
    counts as they were (the step is chosen away on the device, its inf gradients
    included); 0 gives the bits of a step without a flag; never read to the host.
    `takes_overflow_flag` lets the engine hand Muon the flag instead of reading it."""
    from bigbatch.engine.step import takes_overflow_flag

    plain = _flag_step(kernel, [None, None])
    zero = _flag_step(kernel, [None, 0.0])
    skipped = _flag_step(kernel, [None, 1.0, None])
    for a, b, c in zip(plain, zero, skipped, strict=True):
        assert a.keys() == b.keys() == c.keys()
        for k in a:
            assert torch.equal(a[k], c[k]), k
            if kernel == "reference":  # AdamW's plain rule: bias corrections on the device
                torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=k)
            else:  # torch's fused AdamW reads the flag itself; Muon's part is the same ops
                assert torch.equal(a[k], b[k]), k
    assert takes_overflow_flag(Muon([torch.zeros(2, 2, requires_grad=True)]))
