"""K-FAC: the closed form, ASDL, merge and 2 ranks against the big batch, exact resume,
pass-through, and bad input through the CLI."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn

from bigbatch.config.strategy import Strategy
from bigbatch.engine import prepare
from bigbatch.engine.kfac import _assign
from bigbatch.errors import ConfigError
from bigbatch.optim import kfac as K
from bigbatch.parallel.world import World

DT = torch.float64
ONE = World()
N, L, STEPS = 64, 12, 5


class ConvNet(nn.Module):
    """Conv1d, Conv1d (strided, no bias), Linear; no BatchNorm, so merging is exact."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.Tanh(),
                                  nn.Conv1d(4, 6, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm1d(6) if bn else nn.Identity(), nn.Tanh())
        self.fc = nn.Linear(6 * L // 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x.unsqueeze(1)).flatten(1))


def make_model(bn: bool = False) -> ConvNet:
    torch.manual_seed(0)
    return ConvNet(bn).to(DT)


def make_data(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps, N, L, generator=g, dtype=DT), torch.randint(0, 3, (steps, N), generator=g)


def kfac_strategy(micro: int = N, k: int = 1, lars: bool = False, **kfac) -> Strategy:
    d = {"batch": {"global_batch_size": N, "micro_batch_size": micro,
                   "base_batch_size": N, "base_lr": 0.1, "scaling": "none", "decay": "cosine"},
         "optimizer": {"momentum": 0.9, "weight_decay": 0.0 if lars else 1e-4},
         "kfac": {"damping": 0.01, "inv_update_freq": 2, "kl_clip": 0.01, **kfac}}
    if k > 1:
        d["gradient_merge"] = {"k_steps": k}
    if lars:
        d["lars"] = {"lars_coeff": 0.02, "exclude_from_weight_decay": ["bias"]}
    return Strategy.from_dict(d)


def feed(run, x, y, micro: int, steps: range, rank: int = 0, world: int = 1) -> None:
    """Each micro-step, rank r takes its `micro` rows of the next world*micro rows."""
    for step in steps:
        for j in range(0, N, world * micro):
            rows = slice(j + rank * micro, j + (rank + 1) * micro)
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[step, rows]), y[step, rows]))
        assert ms.stepped


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_close(a, b, tol: float = 1e-10) -> None:
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)


def big_batch(s: Strategy | None = None) -> list[torch.Tensor]:
    x, y = make_data()
    run = prepare(make_model(), s or kfac_strategy(), total_steps=STEPS, world=ONE)
    feed(run, x, y, N, range(STEPS))
    return params_of(run.module)


# ---------------------------------------------------------------- closed form


def _independent_batch(d_in=3, d_out=2, n_in=6, n_out=4):
    """Every pairing of `n_in` inputs with `n_out` output gradients: the sample moments of
    ā ā^T and g g^T factorise exactly, so F = A ⊗ G."""
    g = torch.Generator().manual_seed(3)
    a, c = torch.randn(n_in, d_in, generator=g, dtype=DT), torch.randn(n_out, d_out, generator=g, dtype=DT)
    return a.repeat_interleave(n_out, 0), c.repeat(n_in, 1)


def _dense_fisher(X, C):
    """Per-sample gradients of ℓ_n = <W x_n + b, c_n> (vec column-major), F and the mean."""
    ab = torch.cat([X, torch.ones(len(X), 1, dtype=DT)], 1)
    per = torch.stack([torch.outer(c, a).t().reshape(-1) for a, c in zip(ab, C, strict=True)])
    return per.t() @ per / len(X), per.mean(0), ab.shape[1]


def test_preconditioned_gradient_is_the_dense_natural_gradient():
    X, C = _independent_batch()
    Fd, grad, d_a = _dense_fisher(X, C)
    lin = nn.Linear(3, 2).to(DT)
    A = K.factor_sum(K.layer_inputs(lin, X)) / len(X)
    G = K.factor_sum(K.layer_output_grads(lin, C)) / len(X)
    torch.testing.assert_close(Fd, torch.kron(A, G))  # the Kronecker factorisation is exact
    gmat = grad.reshape(d_a, 2).t()
    (QA, dA), (QG, dG) = K.eigen(A), K.eigen(G)
    exact = torch.linalg.solve(Fd, grad).reshape(d_a, 2).t()
    tiny = K.damped_eigen(dA, dG, 1e-20, K.pi_correction(A, G))
    torch.testing.assert_close(K.precondition(gmat, QA, tiny[0], QG, tiny[1]), exact,
                               rtol=1e-8, atol=1e-8)
    # damped: (A + π√λ I) ⊗ (G + √λ/π I), π from the traces
    lam, pi = 0.1, ((A.trace() / d_a) / (G.trace() / 2)).sqrt()
    damped = torch.kron(A + pi * lam**0.5 * torch.eye(d_a, dtype=DT), G + lam**0.5 / pi * torch.eye(2, dtype=DT))
    dA2, dG2 = K.damped_eigen(dA, dG, lam, K.pi_correction(A, G))
    torch.testing.assert_close(K.precondition(gmat, QA, dA2, QG, dG2),
                               torch.linalg.solve(damped, grad).reshape(d_a, 2).t())


def test_engine_step_is_the_dense_natural_gradient_with_merge():
    """Through prepare(): 4 merged micro-steps, lr 1, no momentum -> w1 = w0 - F^-1 grad."""
    X, C = _independent_batch()
    Fd, grad, d_a = _dense_fisher(X, C)
    n = len(X)
    s = Strategy.from_dict({"batch": {"global_batch_size": n, "micro_batch_size": n // 4,
                                      "base_batch_size": n, "base_lr": 1.0, "scaling": "none",
                                      "decay": "none"},
                            "optimizer": {"momentum": 0.0}, "gradient_merge": {"k_steps": 4},
                            "kfac": {"damping": 1e-20, "kl_clip": 0.0}})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).to(DT)
    before = torch.cat([model[0].weight, model[0].bias[:, None]], 1).detach().clone()
    run = prepare(model, s, total_steps=2, world=ONE)
    for j in range(4):
        rows = slice(j * n // 4, (j + 1) * n // 4)
        with run.micro_step() as ms:
            ms.backward((run.model(X[rows]) * C[rows]).sum(1).mean())
    after = torch.cat([model[0].weight, model[0].bias[:, None]], 1).detach()
    torch.testing.assert_close(before - after, torch.linalg.solve(Fd, grad).reshape(d_a, 2).t(),
                               rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("conv, shape", [
    (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2), (5, 3, 11)),
    (lambda: nn.Conv1d(3, 4, 4, padding="same"), (5, 3, 11)),
    (lambda: nn.Conv1d(3, 4, 3, bias=False), (3, 11)),  # unbatched
    (lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)), (5, 3, 9, 8)),
    (lambda: nn.Conv2d(3, 4, 3, padding="same", bias=False), (2, 3, 6, 7)),
    (lambda: nn.Conv2d(3, 4, (2, 3), stride=(1, 2), padding=(2, 1), dilation=(3, 1)), (2, 3, 9, 8)),
    (lambda: nn.Conv2d(3, 4, 3, padding="valid", dilation=2), (3, 7, 8)),  # unbatched
])
def test_patch_rows_times_output_grads_give_the_weight_gradient(conv, shape):
    torch.manual_seed(0)
    m = conv().to(DT)
    x = torch.randn(*shape, dtype=DT)
    out = m(x)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    rows = K.layer_inputs(m, x)
    got = K.layer_output_grads(m, g).t() @ rows
    torch.testing.assert_close(got, K.grad_matrix(m.weight.grad, m.bias.grad if m.bias is not None else None))


def test_kl_clip_bounds_the_step():
    g = [torch.randn(3, 4, dtype=DT), torch.randn(2, 5, dtype=DT)]
    p = [2 * t for t in g]  # <P, g> = 2 |g|^2
    vg = 2 * sum((t * t).sum() for t in g)
    nu = K.kl_clip_scale(p, g, lr=0.5, kl_clip=1e-3)
    torch.testing.assert_close(nu, (1e-3 / (0.25 * vg)).sqrt())
    assert float(nu**2 * 0.25 * vg) == pytest.approx(1e-3)
    assert float(K.kl_clip_scale(p, g, lr=1e-6, kl_clip=1e-3)) == 1.0


# ---------------------------------------------------------------- ASDL (test extra)


def test_one_step_agrees_with_asdl():
    asdl = pytest.importorskip("asdl", reason="ASDL (pip install asdfghjkl) is a test extra")
    x2 = torch.randn(32, 2, 7, 7, dtype=DT)
    models = [(lambda: nn.Sequential(nn.Linear(5, 7, bias=False), nn.Tanh(), nn.Linear(7, 3, bias=False)),
               torch.randn(32, 5, dtype=DT)),
              (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.Tanh(),
                                     nn.Conv2d(4, 3, 3, stride=2, bias=False), nn.Flatten(),
                                     nn.Linear(27, 3, bias=False)), x2)]
    for make, x in models:  # no biases: ASDL preconditions a bias by G alone
        y = torch.randint(0, 3, (32,))
        torch.manual_seed(1)
        ref = make().to(DT)
        gm = asdl.KfacGradientMaker(ref, asdl.PreconditioningConfig(damping=0.01, data_size=32),
                                    fisher_type="fisher_emp")
        gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(ref, x), y)
        gm.forward_and_backward()
        torch.manual_seed(1)
        model = make().to(DT)
        before = params_of(model)
        s = Strategy.from_dict({"batch": {"global_batch_size": 32, "base_batch_size": 32,
                                          "base_lr": 1.0, "scaling": "none", "decay": "none"},
                                "optimizer": {"momentum": 0.0},
                                "kfac": {"damping": 0.01, "kl_clip": 0.0}})
        run = prepare(model, s, total_steps=1, world=ONE)
        with run.micro_step() as ms:
            ms.backward(F.cross_entropy(run.model(x), y))
        for b, a, r in zip(before, params_of(model), ref.parameters(), strict=True):
            torch.testing.assert_close(b - a, r.grad, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- merge, tokens, 2 ranks


@pytest.mark.parametrize("lars", [False, True])
def test_merge_k4_equals_big_batch(lars):
    x, y = make_data()
    ref = big_batch(kfac_strategy(lars=lars))
    run = prepare(make_model(), kfac_strategy(micro=N // 4, k=4, lars=lars), total_steps=STEPS, world=ONE)
    feed(run, x, y, N // 4, range(STEPS))
    assert run.k_steps == 4
    assert_close(params_of(run.module), ref)
    plain = prepare(make_model(), kfac_strategy(lars=lars).with_overrides(["kfac.enable=false"]),
                    total_steps=STEPS, world=ONE)
    feed(plain, x, y, N, range(STEPS))
    assert (params_of(plain.module)[0] - ref[0]).abs().max() > 1e-3  # K-FAC did something


def test_token_counts_merge_equals_big_batch():
    """Summed losses with `count=`: a Linear over positions, counts differing per micro-step."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, N, 5, 4, generator=g, dtype=DT)
    y = torch.randint(0, 3, (3, N, 5), generator=g)
    mask = torch.arange(5) < torch.randint(1, 6, (3, N, 1), generator=g)
    out = []
    for micro, k in ((N, 1), (N // 4, 4)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)
        run = prepare(model, kfac_strategy(micro, k), total_steps=3, world=ONE)
        for step in range(3):
            for i in range(0, N, micro):
                m = mask[step, i:i + micro]
                with run.micro_step() as ms:
                    logits = run.model(x[step, i:i + micro])
                    ms.backward(F.cross_entropy(logits[m], y[step, i:i + micro][m], reduction="sum"),
                                count=m.sum())
        out.append(params_of(model))
    assert_close(out[1], out[0])


def _two_ranks() -> dict:
    from bigbatch.engine import kfac as engine_kfac

    calls = []
    real = engine_kfac.K.eigen
    engine_kfac.K.eigen = lambda f: calls.append(f.shape[0]) or real(f)
    x, y = make_data()
    run = prepare(make_model(), kfac_strategy(micro=N // 4, k=2), total_steps=STEPS)
    assert run.world.world_size == 2 and run.model is not run.module
    feed(run, x, y, N // 4, range(STEPS), int(os.environ["RANK"]), 2)
    return {"params": params_of(run.module), "eigen_calls": calls}


def test_two_ranks_equal_one_process_on_the_gathered_batch():
    results = run_workers(_two_ranks, world_size=2, timeout=120, init_group=True)
    ref = big_batch()
    for r in results:
        assert_close(r["params"], ref)
    # 3 layers x 2 factors at steps 0, 2, 4, split between the ranks
    c0, c1 = results[0]["eigen_calls"], results[1]["eigen_calls"]
    assert len(c0) + len(c1) == 18 and c0 and c1


def test_decompositions_go_largest_first_to_the_least_loaded_rank():
    jobs = [(type("L", (), {"A": torch.zeros(n, n)})(), "A") for n in (10, 3, 9, 2, 1)]
    assert _assign(jobs, 2) == [0, 1, 1, 1, 1]
    assert _assign(jobs, 1) == [0] * 5


# ---------------------------------------------------------------- state, skips, pass-through


@pytest.mark.parametrize("micro_at", [0, 2])
def test_state_dict_round_trip_resumes_bit_identically(micro_at):
    """Stop after 2 steps (+ `micro_at` micro-steps of the 3rd, whose factor sums are then
    in the state), rebuild, load, finish."""
    x, y = make_data()
    s = kfac_strategy(micro=N // 4, k=4, inv_update_freq=3, factor_update_freq=2)

    def micro_steps(run, step, js):
        for j in js:
            rows = slice(j * N // 4, (j + 1) * N // 4)
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[step, rows]), y[step, rows]))

    full = prepare(make_model(), s, total_steps=STEPS, world=ONE)
    for step in range(STEPS):
        micro_steps(full, step, range(4))
    half = prepare(make_model(), s, total_steps=STEPS, world=ONE)
    for step in range(2):
        micro_steps(half, step, range(4))
    micro_steps(half, 2, range(micro_at))
    saved = copy.deepcopy({"model": half.module.state_dict(), "run": half.state_dict()})
    assert saved["run"]["extra"]["kfac"]["factor_updates"] == 1
    model = make_model()
    model.load_state_dict(saved["model"])
    resumed = prepare(model, s, total_steps=STEPS, world=ONE)
    resumed.load_state_dict(saved["run"])
    micro_steps(resumed, 2, range(micro_at, 4))
    for step in (3, 4):
        micro_steps(resumed, step, range(4))
    for p, q in zip(params_of(resumed.module), params_of(full.module), strict=True):
        assert torch.equal(p, q)


def test_the_loss_scale_leaves_the_step_unchanged():
    """fp16 with loss scale 1024 and 1: the output-factor sums see scaled gradients."""
    x, y = make_data(3)
    out = []
    for scale in (1024.0, 1.0):
        s = kfac_strategy().with_overrides(
            ["amp.dtype=float16", f"amp.init_loss_scaling={scale}", "amp.use_dynamic_loss_scaling=false"])
        model = make_model().float()
        run = prepare(model, s, total_steps=3, world=ONE)
        feed(run, x.float(), y, N, range(3))
        out.append(params_of(model))
    assert_close(out[0], out[1], tol=1e-4)


def test_a_skipped_window_adds_nothing_to_the_factors():
    x, y = make_data()
    run = prepare(make_model(), kfac_strategy(micro=N // 4, k=4), total_steps=STEPS, world=ONE)
    for j in range(3):  # three micro-steps, then the window is dropped
        with run.micro_step() as ms:
            ms.backward(F.cross_entropy(run.model(x[4, j * 16:(j + 1) * 16]), y[4, j * 16:(j + 1) * 16]))
    run.skip_step()
    feed(run, x, y, N // 4, range(STEPS))
    assert run.step == STEPS
    ref = prepare(make_model(), kfac_strategy(micro=N // 4, k=4), total_steps=STEPS, world=ONE)
    feed(ref, x, y, N // 4, range(STEPS))
    assert_close(params_of(run.module), params_of(ref.module))


def test_other_modules_and_excluded_layers_pass_through():
    x, y = make_data(1)
    s = kfac_strategy(exclude=["body.0"])
    run = prepare(make_model(bn=True), s, total_steps=1, world=ONE, track_stats=True)
    seen = {}
    run.grad_hooks.insert(0, lambda info: seen.update(before={n: p.grad.clone() for n, p in run.module.named_parameters()}))
    run.grad_hooks.append(lambda info: seen.update(after={n: p.grad.clone() for n, p in run.module.named_parameters()}))
    feed(run, x, y, N, range(1))
    assert [layer.name for layer in run.state_objects["kfac"].layers] == ["body.2", "fc"]
    for name, g in seen["before"].items():
        changed = not torch.equal(g, seen["after"][name])
        assert changed == name.startswith(("body.2", "fc")), name
    raw = torch.stack([g.norm() for g in seen["before"].values()]).norm()
    assert run.stats["grad_norm"] == pytest.approx(float(raw))  # the gradient's, not the step's


def test_recompute_counts_each_forward_once():
    ref = big_batch()
    s = kfac_strategy().with_overrides(['recompute.checkpoints=["body"]'])
    assert_close(big_batch(s), ref)


def test_unknown_exclude_and_nothing_to_precondition_are_config_errors():
    with pytest.raises(ConfigError, match="kfac.exclude: no module named 'conv9'"):
        prepare(make_model(), kfac_strategy(exclude=["conv9"]), total_steps=1, world=ONE)
    with pytest.raises(ConfigError, match="no trainable layer"):
        prepare(make_model(), kfac_strategy(layers=["Conv2d"]), total_steps=1, world=ONE)
    assert K.unsupported_reason(nn.Conv1d(4, 4, 3, groups=2)) is not None
