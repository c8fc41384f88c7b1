"""LARS / LAMB parameter handling (names, groups, exclusion) and argument checks."""

import math

import pytest
import torch
from torch import nn

from bigbatch.optim import LAMB, LARS, param_groups

F64 = torch.float64


def vec(*xs):
    return torch.tensor(xs, dtype=F64)


def close(actual, expected):
    torch.testing.assert_close(actual.detach(), vec(*expected), rtol=1e-12, atol=1e-15)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 2, bias=False)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


# ---------------------------------------------------------------- params argument


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_named_parameters_keep_names_in_order(cls):
    net = Net()
    opt = cls(net.named_parameters(), lr=0.1)
    assert opt.param_names() == [n for n, _ in net.named_parameters()]
    assert opt.param_groups[0]["param_names"] == opt.param_names()
    assert [p for g in opt.param_groups for p in g["params"]] == list(net.parameters())


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_plain_parameters_work_without_names(cls):
    net = Net()
    opt = cls(net.parameters(), lr=0.1)
    assert opt.param_names() == [None] * len(list(net.parameters()))
    before = [p.detach().clone() for p in net.parameters()]
    net(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_exclude_needs_names(cls):
    with pytest.raises(ValueError, match="names") as err:
        cls(Net().parameters(), lr=0.1, exclude=("bias",))
    assert "named_parameters" in str(err.value)
    assert "bias" in str(err.value)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_exclude_splits_groups_and_orders_names(cls):
    opt = cls(Net().named_parameters(), lr=0.1, weight_decay=0.3, exclude=("bias", "norm"))
    assert opt.param_names() == ["fc.weight", "head.weight", "fc.bias", "norm.weight", "norm.bias"]
    kept, dropped = opt.param_groups
    assert kept["weight_decay"] == 0.3 and "layer_adaptation" not in kept and opt._adapts(kept)
    assert dropped["weight_decay"] == 0.0 and dropped["layer_adaptation"] is False


def test_exclude_accepts_a_single_string():
    opt = LARS(Net().named_parameters(), lr=0.1, exclude="bias")
    assert opt.param_names()[-2:] == ["fc.bias", "norm.bias"]


def test_group_overrides_lr_and_weight_decay_lars():
    # Same w and g in two groups; lr and weight_decay differ per group.
    a, b = nn.Parameter(vec(3.0, 4.0)), nn.Parameter(vec(3.0, 4.0))
    opt = LARS(
        # weight_decay 0 alone would turn b's trust ratio off (the group rule).
        [{"params": [a]}, {"params": [b], "lr": 0.2, "weight_decay": 0.0,
                           "layer_adaptation": True}],
        lr=0.1,
        momentum=0.9,
        weight_decay=0.1,
        trust_coefficient=0.01,
    )
    a.grad, b.grad = vec(0.6, 0.8), vec(0.6, 0.8)
    opt.step()
    local_a = 0.1 * 0.01 * 5.0 / (1.0 + 0.1 * 5.0)
    close(a, (3.0 - local_a * (0.6 + 0.3), 4.0 - local_a * (0.8 + 0.4)))
    local_b = 0.2 * 0.01 * 5.0 / (1.0 + 0.0)
    close(b, (3.0 - local_b * 0.6, 4.0 - local_b * 0.8))


def test_group_overrides_lr_and_weight_decay_lamb():
    a, b = nn.Parameter(vec(3.0, 4.0)), nn.Parameter(vec(3.0, 4.0))
    opt = LAMB(
        [{"params": [a], "weight_decay": 0.0, "layer_adaptation": True},
         {"params": [b], "lr": 0.02}],
        lr=0.01,
        betas=(0.5, 0.75),
        eps=0.1,
        weight_decay=0.1,
    )
    a.grad, b.grad = vec(0.6, -0.8), vec(0.6, -0.8)
    opt.step()
    r = (0.6 / 0.7, -0.8 / 0.9)
    ratio_a = 5.0 / math.hypot(*r)
    close(a, (3.0 - 0.01 * ratio_a * r[0], 4.0 - 0.01 * ratio_a * r[1]))
    u = (r[0] + 0.3, r[1] + 0.4)
    ratio_b = 5.0 / math.hypot(*u)
    close(b, (3.0 - 0.02 * ratio_b * u[0], 4.0 - 0.02 * ratio_b * u[1]))


def test_named_groups_with_exclude_keep_group_overrides():
    net = Net()
    opt = LARS(
        [
            {"params": net.fc.named_parameters(prefix="fc"), "lr": 0.5},
            {"params": net.head.named_parameters(prefix="head")},
        ],
        lr=0.1,
        weight_decay=0.2,
        exclude=("bias",),
    )
    by_names = {tuple(g["param_names"]): g for g in opt.param_groups}
    assert set(by_names) == {("fc.weight",), ("fc.bias",), ("head.weight",)}
    assert by_names[("fc.weight",)]["lr"] == 0.5
    assert by_names[("fc.weight",)]["weight_decay"] == 0.2
    bias = by_names[("fc.bias",)]
    assert bias["lr"] == 0.5 and bias["weight_decay"] == 0.0
    assert bias["layer_adaptation"] is False
    assert by_names[("head.weight",)]["lr"] == 0.1


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_step_calls_closure_with_grad_and_returns_loss(cls):
    net = Net()
    opt = cls(net.parameters(), lr=0.1)
    x = torch.randn(5, 4)

    def closure():
        opt.zero_grad()
        loss = net(x).square().sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert all(p.grad is not None for p in net.parameters())


# ---------------------------------------------------------------- param_groups()


def test_param_groups_default_rule_is_ndim():
    net = Net()
    net.head.weight.requires_grad_(False)
    groups = param_groups(net, 0.05)
    assert len(groups) == 2
    decay, no_decay = groups
    assert decay["param_names"] == ["fc.weight"]  # frozen head.weight is left out
    assert decay["params"] == [net.fc.weight]
    assert decay["weight_decay"] == 0.05 and decay["layer_adaptation"] is True
    assert no_decay["param_names"] == ["fc.bias", "norm.weight", "norm.bias"]
    assert all(p.ndim <= 1 for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0 and no_decay["layer_adaptation"] is False


def test_param_groups_exclude_uses_names():
    net = Net()
    decay, no_decay = param_groups(net.named_parameters(), 0.05, exclude=("bias",))
    assert decay["param_names"] == ["fc.weight", "norm.weight", "head.weight"]
    assert no_decay["param_names"] == ["fc.bias", "norm.bias"]


def test_param_groups_drops_empty_groups_and_rejects_plain_params():
    groups = param_groups(nn.Linear(3, 3, bias=False), 0.1)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    with pytest.raises(ValueError):
        param_groups(Net().parameters(), 0.1)


def test_param_groups_feed_lars_and_torch_optimizers():
    net = Net()
    opt = LARS(param_groups(net, 0.1), lr=0.1)
    opt.track_trust_ratios = True
    assert opt.param_names() == ["fc.weight", "head.weight", "fc.bias", "norm.weight", "norm.bias"]
    net(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    ratios = opt.trust_ratios()
    assert ratios.shape == (5,)
    assert (ratios[:2] != 1.0).all() and (ratios[2:] == 1.0).all()  # no-decay group: no ratio
    torch.optim.AdamW(param_groups(net, 0.1), lr=1e-3).step()  # same groups, plain torch


# ---------------------------------------------------------------- bad arguments

NAN = float("nan")
BAD = [
    (LARS, {"lr": -0.1}, "lr=-0.1", "[0.0, inf)"),
    (LARS, {"lr": NAN}, "lr=nan", "[0.0, inf)"),
    (LARS, {"momentum": 1.0}, "momentum=1.0", "[0.0, 1.0)"),
    (LARS, {"momentum": -0.1}, "momentum=-0.1", "[0.0, 1.0)"),
    (LARS, {"weight_decay": -1e-4}, "weight_decay=-0.0001", "[0.0, inf)"),
    (LARS, {"eps": -1e-8}, "eps=-1e-08", "[0.0, inf)"),
    (LARS, {"trust_coefficient": 0.0}, "trust_coefficient=0.0", "(0.0, inf)"),
    (LAMB, {"lr": -1e-3}, "lr=-0.001", "[0.0, inf)"),
    (LAMB, {"lr": NAN}, "lr=nan", "[0.0, inf)"),
    (LAMB, {"betas": (1.0, 0.999)}, "betas[0]=1.0", "[0.0, 1.0)"),
    (LAMB, {"betas": (-0.1, 0.999)}, "betas[0]=-0.1", "[0.0, 1.0)"),
    (LAMB, {"betas": (0.9, 1.5)}, "betas[1]=1.5", "[0.0, 1.0)"),
    (LAMB, {"betas": (0.9, NAN)}, "betas[1]=nan", "[0.0, 1.0)"),
    (LAMB, {"eps": -1e-6}, "eps=-1e-06", "[0.0, inf)"),
    (LAMB, {"weight_decay": -0.01}, "weight_decay=-0.01", "[0.0, inf)"),
    (LAMB, {"max_grad_norm": 0.0}, "max_grad_norm=0.0", "(0.0, inf)"),
    (LAMB, {"max_grad_norm": -1.0}, "max_grad_norm=-1.0", "(0.0, inf)"),
]


@pytest.mark.parametrize(
    "cls,kw,named,allowed",
    BAD,
    ids=[f"{c.__name__}-{next(iter(k))}={next(iter(k.values()))}" for c, k, _, _ in BAD],
)
def test_bad_argument_message_names_key_value_range(cls, kw, named, allowed):
    kw = {"lr": 0.1, **kw}
    with pytest.raises(ValueError) as err:
        cls(Net().parameters(), **kw)
    message = str(err.value)
    assert cls.__name__ in message
    assert named in message
    assert allowed in message
    assert "\n" not in message


def test_lamb_betas_must_be_a_pair():
    with pytest.raises(ValueError, match="betas"):
        LAMB(Net().parameters(), betas=(0.9,))


def test_lars_nesterov_needs_momentum():
    with pytest.raises(ValueError, match="nesterov"):
        LARS(Net().parameters(), lr=0.1, momentum=0.0, nesterov=True)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_edge_values_are_accepted(cls):
    kw = {"lr": 0.0, "weight_decay": 0.0, "eps": 0.0}
    kw.update({"momentum": 0.0} if cls is LARS else {"betas": (0.0, 0.0), "max_grad_norm": 1e-9})
    cls(Net().parameters(), **kw)
