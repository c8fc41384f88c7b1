"""docs/trainers.md's Accelerate recipe with the real accelerate (skipped without it): the
block as printed, on 1 process and on 2 gloo ranks; the schedule counts optimizer steps
(10 on either), the accumulation comes from the strategy's plan (4, then 2 a rank), and
the weights equal bigbatch's own loop over the same global batches (1e-6)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from tests._dist import run_workers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _block():
    from tests.test_docs_blocks import blocks

    found = [b for b in blocks(ROOT / "docs" / "trainers.md")
             if "test_integrations_accelerate" in b.reason]
    assert len(found) == 1, "docs/trainers.md should mark one block for this test"
    return found[0]


def _run_block(code):
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "trainers.md", "exec"), namespace)
    ns = namespace
    return {"steps": ns["scheduler"].scheduler.last_epoch, "k": ns["plan"].k_steps,
            "extra": ns["scheduler"].scheduler.extra_calls,
            "weights": [p.detach().clone() for p in ns["accelerator"].unwrap_model(
                ns["model"]).parameters()]}


def _own_loop():
    """The recipe's strategy, data and model in a plain loop: 10 steps of 64 rows."""
    import bigbatch

    code = _block().code
    strategy = bigbatch.Strategy.from_toml(code.split('"""')[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x = torch.randn(640, 8)
    y = x[:, :1] * 2
    optimizer = bigbatch.build_optimizer(model, strategy, data_degree=1)
    scheduler = bigbatch.build_scheduler(optimizer, strategy, total_steps=10, data_degree=1)
    for s in range(10):
        xb, yb = x[64 * s:64 * (s + 1)], y[64 * s:64 * (s + 1)]
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return list(model.parameters())


def _close(got, want):
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max() / b.detach().abs().max()) <= 1e-6


def test_recipe_one_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = _run_block(_block().code)
    assert out["steps"] == 10 and out["k"] == 4 and out["extra"] == 0
    _close(out["weights"], _own_loop())


def _worker(code):
    return _run_block(code)


def test_recipe_two_ranks(monkeypatch):
    """Accelerate steps the scheduler twice per optimizer step here: counted once, and
    the 2 ranks' 2 x 16 x 2 rows a step equal one process's 64. ACCELERATE_USE_CPU is
    what `accelerate launch --cpu` sets (without it, torchrun's env alone leaves
    Accelerate on one process on a machine without a GPU)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    results = run_workers(_worker, world_size=2, args=(_block().code,), timeout=120)
    want = _own_loop()
    for out in results:
        assert out["steps"] == 10 and out["k"] == 2 and out["extra"] == 10
        _close(out["weights"], want)
