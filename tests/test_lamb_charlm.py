"""charlm's LAMB settings (benchmarks/NOTES-lamb-charlm.md): LAMB's own LR at the recipe's
batch, not AdamW's, and the trust ratio on every weight matrix and the embedding but not
on norms and biases."""

import math
import tomllib

import pytest
import torch

from bigbatch import Strategy
from bigbatch.engine.optimizer import build_optimizer
from bigbatch.tasks.charlm import _RECIPES, DEMO_STRATEGY, CharTransformer
from tests._cli import ROOT

EXAMPLE = ROOT / "examples" / "lamb_charlm.toml"


def _demo(batch: int) -> Strategy:
    """The demo at a fixed `batch` (the demo itself grows from 16 to 128)."""
    return Strategy.from_toml(DEMO_STRATEGY).with_overrides([
        f"batch.global_batch_size={batch}", "batch.schedule=fixed", "batch.start_batch_size=none"])


def test_lamb_takes_its_own_lr_at_the_recipes_batch():
    """At AdamW's 2e-3 LAMB ended at 2.72 bits/char against AdamW's 1.94: LAMB moves a tensor
    by about lr x its norm per step, so the demo's LR at batch 16 is LAMB's measured one
    (0.011; 0.011 to 0.023 beat AdamW), square-root scaled to 0.031 at the demo's 128."""
    recipe = _RECIPES["transformer"]
    at_16 = _demo(16)
    assert at_16.lamb.enable and at_16.batch.base_batch_size == recipe.base_batch_size
    peak_16 = at_16.resolve(1).peak_lr
    assert peak_16 == pytest.approx(0.011)
    assert peak_16 >= 4 * recipe.base_lr
    assert _demo(128).resolve(1).peak_lr == pytest.approx(0.011 * math.sqrt(8))
    demo = Strategy.from_toml(DEMO_STRATEGY)  # grows 16 -> 128, the peak doubling with it
    assert demo.resolve(1).peak_lr == pytest.approx(0.011)
    assert demo.ceiling(1).peak_lr == pytest.approx(0.011 * 8)
    # The example is the demo at the recipe's batch, so the NOTES' numbers are its numbers.
    assert tomllib.loads(EXAMPLE.read_text())["task"] == "charlm"
    assert Strategy.from_toml(EXAMPLE) == at_16


def test_trust_ratio_on_embeddings_and_matrices_not_on_norms_and_biases():
    """Excluding the (tied) embedding from the trust ratio cost 0.02 bits/char at LAMB's LR,
    a trust ratio on the LayerNorms and biases 0.07: the demo's LAMB keeps both ways."""
    torch.manual_seed(0)
    model = CharTransformer(vocab_size=20, seq_len=8, d_model=8, n_layer=1, n_head=2)
    opt = build_optimizer(model, _demo(16), lr=0.011)
    opt.track_trust_ratios = True
    model(torch.randint(0, 20, (4, 8))).square().mean().backward()
    opt.step()
    names = [n for g in opt.param_groups for n in g["param_names"]]
    ratios = dict(zip(names, opt.trust_ratios().tolist(), strict=True))
    assert set(ratios) == {n for n, _ in model.named_parameters()}
    adapted = {n for n, r in ratios.items() if r != 1.0}
    assert adapted == {n for n in ratios if n.endswith("weight") and "norm" not in n}
    assert {"tok_emb.weight", "pos_emb.weight"} <= adapted  # the head is tok_emb's weight
    assert ratios["tok_emb.weight"] < 0.1  # ||w|| / ||u||: an init of std 0.02 against ~1
    decay = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert {n for n, wd in decay.items() if wd > 0} == adapted
