"""The migration table of docs/trainers.md ("Coming from timm's `Lamb` and `Lars`"), checked.

Float64 reference implementations of timm's ``Lamb`` and ``Lars`` update rules, written
from their published algorithms (NVIDIA's LAMB with global-norm pre-normalisation; LARS /
LARC as in apex, with torch's SGD momentum), are compared with ``bigbatch.LAMB`` /
``bigbatch.LARS`` built from the table's settings: 10 steps at a constant LR on a model
written the way users write them, with timm's parameter groups (biases and norms in a
group with weight decay 0). The weights agree to 1e-12 relative.

The real timm is optional: where a ``timm`` distribution is findable, its ``Lamb`` and
``Lars`` are compared with the same references. ``import timm`` pulls in torchvision;
when that fails, only ``timm.optim.lamb`` and ``timm.optim.lars`` are loaded, under bare
``timm`` / ``timm.optim`` package modules (timm/__init__.py is not executed), and
``sys.modules`` is restored afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types

import pytest
import torch
from torch import nn

import bigbatch

STEPS = 10
TOL = 1e-12


# --------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Embedding, two nested blocks, a final norm and an untied head."""

    def __init__(self, width: int = 8, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))))


def make_models(n: int) -> list[Net]:
    torch.manual_seed(0)
    model = Net().double()
    with torch.no_grad():  # norms away from their (1, 0) start, so every tensor has a norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    models = [model]
    for _ in range(n - 1):
        other = Net().double()
        other.load_state_dict(model.state_dict())
        models.append(other)
    return models


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=gen, dtype=torch.float64),
             torch.randint(0, 5, (16,), generator=gen)) for _ in range(STEPS)]


def backward(model: Net, x, y, scale: float) -> None:
    model.zero_grad(set_to_none=True)
    # `scale` * mean loss: a scale of 16 gives global gradient norms above 1 (timm's clip).
    (scale * nn.functional.cross_entropy(model(x), y)).backward()


def timm_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """timm's ``param_groups_weight_decay``: ndim <= 1 tensors (biases, norm gains)
    in a group with weight decay 0, the rest with ``weight_decay``."""
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    decay = [p for p in model.parameters() if p.ndim > 1]
    return [dict(params=no_decay, weight_decay=0.0),
            dict(params=decay, weight_decay=weight_decay)]


def worst(a: Net, b: Net) -> float:
    """The largest relative difference over the tensors of two models."""
    out = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        out = max(out, ((p - q).norm() / q.norm()).item())
    return out


# --------------------------------------------------------------------------- references


class RefLamb:
    """timm's ``Lamb`` (NVIDIA's LAMB), float64, from its published algorithm.

    ``g <- g / max(1, ||G|| / max_grad_norm)`` over all gradients (G) when clipping;
    ``m = beta1 m + beta3 g`` (``beta3 = 1 - beta1``, or 1 without grad averaging);
    ``v = beta2 v + (1 - beta2) g^2``; ``u = (m / bc1) / (sqrt(v / bc2) + eps) + wd w``;
    where ``wd != 0`` or always_adapt: ``u *= ||w|| / ||u||`` (1 if a norm is 0; at most
    1 with trust_clip); ``w -= lr u``. The step count is per group.
    """

    def __init__(self, groups, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-6,
                 bias_correction=True, grad_averaging=True, max_grad_norm=1.0,
                 trust_clip=False, always_adapt=False):
        self.groups = [dict(g) for g in groups]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.bias_correction, self.grad_averaging = bias_correction, grad_averaging
        self.max_grad_norm, self.trust_clip, self.always_adapt = (
            max_grad_norm, trust_clip, always_adapt)
        self.state: dict[int, list] = {}
        self.clipped = 0  # steps where the clip was active

    @torch.no_grad()
    def step(self):
        beta1, beta2 = self.betas
        divisor = 1.0
        if self.max_grad_norm is not None:
            total = math.sqrt(sum(float((p.grad * p.grad).sum())
                                  for g in self.groups for p in g["params"]))
            divisor = max(1.0, total / self.max_grad_norm)
            self.clipped += divisor > 1.0
        for group in self.groups:
            group["t"] = t = group.get("t", 0) + 1
            bc1 = 1 - beta1 ** t if self.bias_correction else 1.0
            bc2 = 1 - beta2 ** t if self.bias_correction else 1.0
            beta3 = 1 - beta1 if self.grad_averaging else 1.0
            wd = group["weight_decay"]
            for w in group["params"]:
                g = w.grad / divisor
                m, v = self.state.setdefault(id(w), [torch.zeros_like(w), torch.zeros_like(w)])
                m.copy_(beta1 * m + beta3 * g)
                v.copy_(beta2 * v + (1 - beta2) * g * g)
                u = (m / bc1) / ((v / bc2).sqrt() + self.eps) + wd * w
                ratio = 1.0
                if wd != 0 or self.always_adapt:
                    w_norm, u_norm = float(w.norm()), float(u.norm())
                    if w_norm > 0 and u_norm > 0:
                        ratio = w_norm / u_norm
                    if self.trust_clip:
                        ratio = min(ratio, 1.0)
                w.sub_(self.lr * ratio * u)


class RefLars:
    """timm's ``Lars`` (LARS / LARC after apex, torch's SGD momentum), float64.

    Where ``wd != 0`` or always_adapt: ``r = coeff ||w|| / (||g|| + wd ||w|| + eps)``
    (1 if a norm is 0; LARC's trust_clip: ``min(r / lr, 1)``), ``d = r (g + wd w)``;
    else ``d = g``. Momentum: ``b = d`` at the first step, then
    ``b = momentum b + (1 - dampening) d``; the step is ``b`` (nesterov:
    ``d + momentum b``) and ``w -= lr step``: the LR outside the buffer.
    """

    def __init__(self, groups, *, lr=1.0, momentum=0.0, dampening=0.0, nesterov=False,
                 trust_coeff=1e-3, eps=1e-8, trust_clip=False, always_adapt=False):
        self.groups = [dict(g) for g in groups]
        self.lr, self.momentum, self.dampening, self.nesterov = lr, momentum, dampening, nesterov
        self.trust_coeff, self.eps = trust_coeff, eps
        self.trust_clip, self.always_adapt = trust_clip, always_adapt
        self.buffers: dict[int, torch.Tensor] = {}
        self.ratios: list[float] = []  # adapted ratios before LARC's clip, over all steps

    @torch.no_grad()
    def step(self):
        for group in self.groups:
            wd = group["weight_decay"]
            for w in group["params"]:
                d = w.grad
                if wd != 0 or self.always_adapt:
                    w_norm, g_norm = float(w.norm()), float(d.norm())
                    ratio = 1.0
                    if w_norm > 0 and g_norm > 0:
                        ratio = self.trust_coeff * w_norm / (g_norm + wd * w_norm + self.eps)
                    self.ratios.append(ratio / self.lr)
                    if self.trust_clip:
                        ratio = min(ratio / self.lr, 1.0)
                    d = ratio * (d + wd * w)
                if self.momentum != 0:
                    b = self.buffers.get(id(w))
                    if b is None:
                        b = self.buffers[id(w)] = d.clone()
                    else:
                        b.copy_(self.momentum * b + (1 - self.dampening) * d)
                    d = d + self.momentum * b if self.nesterov else b
                w.sub_(self.lr * d)


# --------------------------------------------------------------------------- the table


# timm's Lamb settings -> bigbatch.LAMB's, as the table gives them.
def bigbatch_lamb(groups, *, lr, betas, eps, bias_correction, max_grad_norm, trust_clip,
                  always_adapt, kernel="auto"):
    return bigbatch.LAMB(groups, lr=lr, betas=betas, eps=eps, bias_correction=bias_correction,
                         max_grad_norm=max_grad_norm, trust_clip=trust_clip,
                         always_adapt=always_adapt, kernel=kernel)


def bigbatch_lars(groups, *, lr, momentum, nesterov, trust_coeff, eps, trust_clip,
                  always_adapt, kernel="auto"):
    return bigbatch.LARS(groups, lr=lr, momentum=momentum, nesterov=nesterov,
                         trust_coefficient=trust_coeff, eps=eps, trust_clip=trust_clip,
                         always_adapt=always_adapt, kernel=kernel)


LAMB_CASES = {
    # timm's defaults: clipping at 1.0, eps 1e-6, betas (0.9, 0.999), weight decay 0.01.
    "defaults": dict(max_grad_norm=1.0),
    "no_clip": dict(max_grad_norm=None),
    "trust_clip": dict(max_grad_norm=1.0, trust_clip=True),
    "always_adapt": dict(max_grad_norm=None, always_adapt=True),
    "no_bias_correction": dict(max_grad_norm=1.0, bias_correction=False),
}

LARS_CASES = {
    "defaults_momentum_0": dict(momentum=0.0),
    "heavy_ball": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "trust_clip": dict(momentum=0.9, trust_clip=True),
    "trust_clip_nesterov": dict(momentum=0.9, trust_clip=True, nesterov=True),
    "always_adapt": dict(momentum=0.9, always_adapt=True),
}


def run_lamb(case: dict, kernel: str = "auto", real=None, foreach: bool = False) -> tuple[float, float, int]:
    """(worst relative difference reference vs bigbatch, vs ``real`` (timm's Lamb class,
    or nan), steps the reference clipped)."""
    s = dict(lr=2e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
             trust_clip=False, always_adapt=False) | case
    wd = s.pop("weight_decay")
    ref, diffs = _race(RefLamb, bigbatch_lamb, real, wd, 16.0, kernel, foreach, s)
    return (*diffs, ref.clipped)


def _race(ref_cls, ours, real, wd: float, scale: float, kernel: str, foreach: bool, s: dict,
          lr_at=None) -> tuple:
    """The reference, bigbatch's and (if given) timm's optimizer on the same batches, each
    on its own copy of the model: (the reference, (worst difference of bigbatch's, of
    timm's or nan)). ``lr_at(step)``: a changing LR."""
    models = make_models(3 if real else 2)
    ref = ref_cls(timm_groups(models[0], wd), **s)
    opts = [ours(timm_groups(models[1], wd), kernel=kernel, **s)]
    if real:
        opts.append(real(timm_groups(models[2], wd), foreach=foreach, **s))
    for i, (x, y) in enumerate(batches()):
        if lr_at is not None:
            ref.lr = lr_at(i)
            for opt in opts:
                for group in opt.param_groups:
                    group["lr"] = lr_at(i)
        backward(models[0], x, y, scale)
        ref.step()
        for model, opt in zip(models[1:], opts, strict=True):
            backward(model, x, y, scale)
            opt.step()
    return ref, (worst(models[1], models[0]),
                 worst(models[2], models[0]) if real else math.nan)


def run_lars(case: dict, lr_at=None, kernel: str = "auto", real=None,
             foreach: bool = False) -> tuple[float, float, list[float]]:
    """(worst relative difference reference vs bigbatch, vs ``real`` (timm's Lars class,
    or nan), the reference's trust ratios over the LR). ``lr_at(step)``: a changing LR."""
    s = dict(lr=0.5, momentum=0.0, nesterov=False, trust_coeff=0.02, eps=1e-8,
             trust_clip=False, always_adapt=False) | case
    ref, diffs = _race(RefLars, bigbatch_lars, real, 1e-3, 1.0, kernel, foreach, s, lr_at)
    return (*diffs, ref.ratios)


@pytest.mark.parametrize("kernel", ["reference", "per_tensor", "multi_tensor"])
@pytest.mark.parametrize("name", list(LAMB_CASES))
def test_lamb_reproduces_timm(name, kernel):
    diff, _, clipped = run_lamb(LAMB_CASES[name], kernel)
    assert diff <= TOL, f"{name}/{kernel}: {diff:.3g}"
    if LAMB_CASES[name]["max_grad_norm"] is not None:
        assert clipped >= 3  # the clip is exercised, not only present


@pytest.mark.parametrize("kernel", ["reference", "per_tensor", "multi_tensor"])
@pytest.mark.parametrize("name", list(LARS_CASES))
def test_lars_reproduces_timm(name, kernel):
    diff, _, ratios = run_lars(LARS_CASES[name], kernel=kernel)
    assert diff <= TOL, f"{name}/{kernel}: {diff:.3g}"
    if LARS_CASES[name].get("trust_clip"):  # LARC's cap binds for some tensors, not all
        assert min(ratios) < 1.0 < max(ratios)


def test_lars_lr_inside_the_buffer_differs_under_a_changing_lr():
    """The table's one mismatch: timm's LR multiplies the buffer, bigbatch's sits in it."""
    diff, _, _ = run_lars(dict(momentum=0.9), lr_at=lambda i: 0.05 * (i + 1))
    assert diff > 1e-4


# --------------------------------------------------------------------------- real timm


@pytest.fixture
def real_timm():
    """timm's ``(Lamb, Lars)`` classes, or a skip; ``sys.modules`` restored afterwards."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("no timm distribution is findable (optional: put timm 1.0.x on PYTHONPATH)")
    before = {k: v for k, v in sys.modules.items() if k == "timm" or k.startswith("timm.")}

    def restore():
        for key in [k for k in sys.modules if k == "timm" or k.startswith("timm.")]:
            del sys.modules[key]
        sys.modules.update(before)

    try:
        try:
            importlib.import_module("timm")
        except Exception:  # timm's __init__ imports torchvision and its models
            restore()
            spec = importlib.util.find_spec("timm")
            root = list(spec.submodule_search_locations or [])
            if not root:
                pytest.skip(f"timm at {spec.origin} is not a package")
            for name, path in (("timm", root), ("timm.optim", [f"{root[0]}/optim"])):
                module = types.ModuleType(name)
                module.__path__ = path
                module.__package__ = name
                sys.modules[name] = module
        lamb = importlib.import_module("timm.optim.lamb")
        lars = importlib.import_module("timm.optim.lars")
    except Exception as exc:  # noqa: BLE001 - any failure to load an optional package
        restore()
        pytest.skip(f"timm's optimizers could not be loaded: {exc!r}")
    try:
        yield lamb.Lamb, lars.Lars
    finally:
        restore()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", list(LAMB_CASES))
def test_lamb_reference_is_timm(real_timm, name, foreach):
    diff, real_diff, _ = run_lamb(LAMB_CASES[name], "reference", real=real_timm[0],
                                  foreach=foreach)
    print(f"LAMB {name} foreach={foreach}: reference vs bigbatch {diff:.3g}, vs timm {real_diff:.3g}")
    assert real_diff <= TOL, f"{name}: {real_diff:.3g}"
    assert diff <= TOL


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", list(LARS_CASES))
def test_lars_reference_is_timm(real_timm, name, foreach):
    diff, real_diff, _ = run_lars(LARS_CASES[name], kernel="reference", real=real_timm[1],
                                  foreach=foreach)
    print(f"LARS {name} foreach={foreach}: reference vs bigbatch {diff:.3g}, vs timm {real_diff:.3g}")
    assert real_diff <= TOL, f"{name}: {real_diff:.3g}"
    assert diff <= TOL
