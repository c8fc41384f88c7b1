"""Every LARS and LAMB kernel does the same thing with an inf or a nan.

The reference kernel is the spec (`bigbatch.optim._steps`): a gradient with an
infinite element has an infinite norm, so LARS's ``local_lr`` is 0 and that tensor's
gradient adds nothing (only the velocity decays, as at lr 0); a nan gradient, and an inf
or nan weight, turn that tensor nan. LAMB's Adam moments make any inf or nan gradient nan.
The fast kernels must give exactly that, not ``0 * inf = nan`` where the reference
selects. Triton runs through its interpreter on CPU (as in ``test_optim_triton``).
"""

import pytest
import torch

from bigbatch.optim import LAMB, LARS, _triton_plan

KERNELS = ["per_tensor", "multi_tensor", "triton"]
CASES = {
    "inf in grad": ("grad", float("inf")),
    "-inf in grad": ("grad", -float("inf")),
    "nan in grad": ("grad", float("nan")),
    "inf in param": ("param", float("inf")),
}
OPTIMIZERS = {
    "LARS": (LARS, dict(lr=0.1, momentum=0.9, weight_decay=1e-4)),
    # always_adapt: weight decay 0 alone would turn the trust ratio off (the group rule).
    "LARS nesterov": (LARS, dict(lr=0.1, momentum=0.9, weight_decay=0.0, nesterov=True,
                                 always_adapt=True)),
    "LAMB": (LAMB, dict(lr=0.01, weight_decay=0.01)),
}


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name, value in dict(CHUNK=16, BLOCK=8, REDUCE_BLOCK=4).items():
        monkeypatch.setattr(_triton_plan, name, value)


def _steps(cls, kw, kernel, case):
    """Two steps: a finite one (momentum state exists), then one with the bad value in
    the first tensor; returns the weights and the optimizer's state tensors."""
    torch.manual_seed(0)
    shapes = [(5, 4), (3,), (20,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(2)]
    where, value = CASES[case]
    opt = cls(params, kernel=kernel, **kw)
    for step, gs in enumerate(grads):
        if step == 1:
            target = gs[0] if where == "grad" else params[0].data
            target[1, 2] = value
        for p, g in zip(params, gs, strict=True):
            p.grad = g
        opt.step()
    state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params], state


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_agree_with_the_reference_on_non_finite_values(kernel, case, optimizer, request):
    if kernel == "triton":
        request.getfixturevalue("interpreter")
    cls, kw = OPTIMIZERS[optimizer]
    ref_w, ref_state = _steps(cls, kw, "reference", case)
    w, state = _steps(cls, kw, kernel, case)
    torch.testing.assert_close(w, ref_w, equal_nan=True, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([s.float() for s in state], [s.float() for s in ref_state],
                               equal_nan=True, rtol=1e-5, atol=1e-6)


def test_the_spec_an_infinite_gradient_leaves_its_tensor_to_the_velocity():
    """The agreed behaviour itself, on the reference: LARS ignores an infinite gradient
    (the weight moves by the decayed velocity only, nothing nan), the other tensors step
    as usual; LAMB's moments turn that tensor nan."""
    w, _ = _steps(*OPTIMIZERS["LARS"], "reference", "inf in grad")
    assert all(torch.isfinite(t).all() for t in w)
    w, _ = _steps(*OPTIMIZERS["LAMB"], "reference", "inf in grad")
    assert torch.isnan(w[0]).all() and torch.isfinite(w[1]).all()

