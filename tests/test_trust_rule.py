"""One trust-ratio rule wherever param groups come from, a model's own
`no_weight_decay()`, and warm starts from another optimizer's state."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch.optim import LAMB, LARS


def net() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    with torch.no_grad():  # no zero biases or unit gains, whose trust ratio is 1 anyway
        for p in m.parameters():
            p.add_(torch.randn_like(p))
    return m


def trainer_groups(m: nn.Module, **extra) -> list[dict]:
    """Groups as a trainer builds them (Hugging Face's Trainer, timm): no bigbatch keys."""
    decay = [p for p in m.parameters() if p.ndim > 1]
    rest = [p for p in m.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": 0.01},
            {"params": rest, "weight_decay": 0.0, **extra}]


def _one_step(opt, m):
    opt.track_trust_ratios = True
    m(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    opt.step()
    return opt.trust_ratios()


@pytest.mark.parametrize("cls", [LAMB, LARS])
def test_a_group_without_weight_decay_gets_no_trust_ratio_unless_it_says_so(cls):
    m = net()
    n_decay = sum(p.ndim > 1 for p in m.parameters())
    ratios = _one_step(cls(trainer_groups(m), lr=0.1), m)
    assert (ratios[:n_decay] != 1).all() and (ratios[n_decay:] == 1).all()
    m = net()
    ratios = _one_step(cls(trainer_groups(m, layer_adaptation=True), lr=0.1), m)
    assert (ratios != 1).all()
    m = net()  # the whole optimizer at weight_decay 0: timm's Lamb/Lars take no ratio either
    assert (_one_step(cls(m.parameters(), lr=0.1, weight_decay=0.0), m) == 1).all()
    m = net()
    assert (_one_step(cls(m.parameters(), lr=0.1, weight_decay=0.0, always_adapt=True),
                      m) != 1).all()


def test_lamb_group_without_trust_ratio_is_adam():
    m, a = net(), net()
    lamb = LAMB(trainer_groups(m), lr=0.1, eps=1e-6)
    adam = torch.optim.Adam([p for p in a.parameters() if p.ndim <= 1], lr=0.1, eps=1e-6)
    for model, opt in ((m, lamb), (a, adam)):
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).sum().backward()
        opt.step()
    for p, q in zip(m.parameters(), a.parameters(), strict=True):
        if p.ndim <= 1:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


class ViTish(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, 4))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 4))
        self.proj = nn.Linear(4, 4)

    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}


@pytest.mark.parametrize("exclude", [None, ("bias",)])
def test_param_groups_honours_no_weight_decay(exclude):
    decay, no_decay = bigbatch.param_groups(ViTish(), 0.05, exclude)
    assert decay["param_names"] == ["proj.weight"]
    assert set(no_decay["param_names"]) == {"pos_embed", "cls_token", "proj.bias"}


class Holder(nn.Module):
    """A trainer's module around a timm-style model (a LightningModule's `self.backbone`)."""

    def __init__(self):
        super().__init__()
        self.backbone = ViTish()
        self.head = nn.Linear(4, 2)


def test_declared_names_of_a_submodule_take_its_path():
    decay, no_decay = bigbatch.param_groups(Holder(), 0.05)
    assert decay["param_names"] == ["backbone.proj.weight", "head.weight"]
    assert {"backbone.pos_embed", "backbone.cls_token"} <= set(no_decay["param_names"])
    # timm's wildcards; names given for (name, param) pairs
    pairs = list(ViTish().named_parameters())
    groups = bigbatch.param_groups(pairs, 0.05, no_weight_decay={"*_embed"})
    assert groups[1]["param_names"] == ["pos_embed", "proj.bias"]


def _strategy(section: str, **keys) -> bigbatch.Strategy:
    opt = "momentum" if section == "lars" else "adamw"
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    return bigbatch.Strategy.from_toml(
        f'[batch]\nbase_lr = 0.1\n[optimizer]\ntype = "{opt}"\n'
        f"[{section}]\nenable = true\n{extra}")


def _pos_embed_group(opt, model):
    return next(g for g in opt.param_groups if any(p is model.pos_embed for p in g["params"]))


def _pos_embed_ratio(opt, model):
    opt.track_trust_ratios = True
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    (model.proj(x + model.pos_embed) + model.cls_token).square().sum().backward()
    opt.step()
    order = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    return float(opt.trust_ratios()[[p is model.pos_embed for p in order].index(True)])


def _vit():
    m = ViTish()
    with torch.no_grad():  # unit-scale weights: a trust ratio would not be 1 by chance
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return m


@pytest.mark.parametrize("section", ["lamb", "lars"])
@pytest.mark.parametrize("exclude", [None, ("bias",)])
def test_the_strategys_optimizer_honours_no_weight_decay(section, exclude):
    """build_optimizer and prepare: pos_embed takes no weight decay and no trust ratio,
    unless always_adapt gives every excluded tensor one."""
    keys = {} if exclude is None else {"exclude_from_weight_decay": list(exclude)}
    strategy = _strategy(section, **keys)
    m = _vit()
    opt = bigbatch.build_optimizer(m, strategy, lr=0.1)
    group = _pos_embed_group(opt, m)
    assert group["weight_decay"] == 0.0 and group["layer_adaptation"] is False
    assert {"pos_embed", "cls_token"} <= set(group["param_names"])
    assert _pos_embed_ratio(opt, m) == 1.0
    run = bigbatch.prepare(m := _vit(), strategy, total_steps=4)
    group = _pos_embed_group(run.optimizer, m)
    assert group["weight_decay"] == 0.0 and group["layer_adaptation"] is False
    m = _vit()
    adapting = bigbatch.build_optimizer(m, _strategy(section, always_adapt=True), lr=0.1)
    assert _pos_embed_group(adapting, m)["weight_decay"] == 0.0
    assert _pos_embed_ratio(adapting, m) != 1.0


def test_muon_groups_honour_no_weight_decay():
    m = Holder()
    strategy = bigbatch.Strategy.from_toml(
        '[optimizer]\ntype = "adamw"\n[muon]\nenable = true\nadamw_params = ["head"]\n')
    opt = bigbatch.build_optimizer(m, strategy, lr=0.01)
    decays = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert decays["backbone.pos_embed"] == decays["backbone.cls_token"] == 0.0
    assert decays["backbone.proj.weight"] > 0


def _trained(opt_cls, named=False, **kw):
    m = net()
    opt = opt_cls(m.named_parameters() if named else m.parameters(), **kw)
    for t in range(3):
        opt.zero_grad()
        m(torch.randn(3, 4, generator=torch.Generator().manual_seed(t))).sum().backward()
        opt.step()
    return m, opt


def test_lamb_warm_starts_from_adamw_moments_keeping_its_own_settings():
    """Groups in another order than AdamW's: matched by name."""
    m, adamw = _trained(torch.optim.AdamW, named=True, lr=0.01, weight_decay=0.1)
    lamb = LAMB(bigbatch.param_groups(m, 0.02), lr=0.5)
    lamb.load_state_dict(adamw.state_dict())
    assert {g["lr"] for g in lamb.param_groups} == {0.5}
    for p in m.parameters():
        assert torch.equal(lamb.state[p]["exp_avg"], adamw.state[p]["exp_avg"])
        assert float(lamb.state[p]["step"]) == 3.0
    _, unnamed = _trained(torch.optim.AdamW, lr=0.01)  # by position, shapes differ
    with pytest.raises(ValueError, match="parameter 1's exp_avg has shape .* match by name"):
        LAMB(bigbatch.param_groups(net(), 0.02), lr=0.5).load_state_dict(unnamed.state_dict())
    m(torch.randn(3, 4)).sum().backward()
    lamb.step()  # no KeyError
    assert float(lamb.state[m[0].weight]["step"]) == 4.0


def test_lars_warm_starts_from_momentum_sgd():
    m, sgd = _trained(torch.optim.SGD, lr=0.05, momentum=0.9)
    lars = LARS(m.parameters(), lr=1.0)
    lars.load_state_dict(sgd.state_dict())
    for p in m.parameters():  # Fleet's velocity v = lr * b
        torch.testing.assert_close(lars.velocity(p), 0.05 * sgd.state[p]["momentum_buffer"])
    m(torch.randn(3, 4)).sum().backward()
    lars.step()


@pytest.mark.parametrize("cls,other,kw,holds", [
    (LAMB, torch.optim.SGD, dict(lr=0.1, momentum=0.9), "momentum_buffer"),
    (LARS, torch.optim.AdamW, dict(lr=0.1), "exp_avg, exp_avg_sq, step"),
])
def test_other_state_is_refused_in_one_line(cls, other, kw, holds):
    m, opt = _trained(other, **kw)
    with pytest.raises(ValueError) as err:
        cls(m.parameters(), lr=0.1).load_state_dict(opt.state_dict())
    text = str(err.value)
    assert "\n" not in text and holds in text and "warm-starts from" in text, text
