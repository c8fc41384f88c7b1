"""bigbatch.integrations.lightning with the real Lightning (skipped without it).

A Lightning run with bigbatch's optimizer, ScheduleLR and NoiseScaleCallback equals
bigbatch's own loop over the same micro-batches (LARS and LAMB, accumulation with a short
last window, float32 1e-6), and the noise scale it logs equals `GradientNoiseScale` fed
the same gradients in that loop; the batch grows between epochs by the noise-scale rule
with the LR following the scaling rule, and a resume keeps the grown accumulation.
On 2 ranks (Lightning's DDP strategy over gloo, each rank a process of tests/_dist joined
through torchrun's environment, as under `torchrun`), the same global batch gives the
one-process run's weights and the noise scale of `GradientNoiseScale` fed the ranks'
gradients. Tiny models, random data, CPU.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from _dist import run_workers

pl = pytest.importorskip("lightning.pytorch")

import bigbatch  # noqa: E402
from bigbatch.integrations.lightning import NoiseScaleCallback, lr_find  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

LAMB = """
[batch]
global_batch_size = 12
micro_batch_size = 4
base_batch_size = 12
base_lr = 0.01
warmup_steps = 2
decay = "cosine"
[optimizer]
type = "adamw"
[lamb]
[gradient_merge]
"""
LARS = LAMB.replace('type = "adamw"\n[lamb]', 'type = "momentum"\n[lars]').replace(
    "base_lr = 0.01", "base_lr = 0.1")
MICRO, K, BATCHES, EPOCHS = 4, 3, 8, 2  # windows of 3, 3 and 2 micro-batches an epoch
STEPS = 3 * EPOCHS


def _net():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data(ranks=1):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO * BATCHES * ranks, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :1] * 2 + 3.0)


def _loss(net, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(net(x), y)


class Module(pl.LightningModule):
    def __init__(self, net, strategy, total_steps, ranks=1):
        super().__init__()
        self.net, self.strategy, self.total_steps = net, strategy, total_steps
        self.ranks = ranks  # the data degree the strategy's LR is scaled to

    def training_step(self, batch, batch_idx):
        loss = _loss(self.net, batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = bigbatch.build_optimizer(self, self.strategy, data_degree=self.ranks)
        scheduler = bigbatch.build_scheduler(optimizer, self.strategy, self.total_steps,
                                             data_degree=self.ranks)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _loader(batch=MICRO, ranks=1):
    return torch.utils.data.DataLoader(_data(ranks), batch_size=batch, shuffle=False)


def _ddp_order(ranks):
    """All ranks' micro-batches as one process's, in the order Lightning's DDP gives them:
    its DistributedSampler shuffles a training set (seed PL_GLOBAL_SEED or 0, reseeded
    each epoch through set_epoch) and rank r takes rows r, r + ranks, ... of the order;
    as one replica it yields that order whole."""
    sampler = torch.utils.data.DistributedSampler(
        _data(ranks), num_replicas=1, rank=0, shuffle=True,
        seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
    return torch.utils.data.DataLoader(_data(ranks), batch_size=MICRO * ranks, sampler=sampler)


def _fit(module, callback, epochs=EPOCHS, root=None, ckpt=None, loader=None, **kw):
    kw.setdefault("devices", 1)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu",
                         accumulate_grad_batches=K, logger=False,
                         enable_checkpointing=root is not None, default_root_dir=root,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback], **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader if loader is not None else _loader(), ckpt_path=ckpt)
    return trainer


def _shares_sq_norm(net, batch, ranks):
    """The ranks' mean squared norm of their micro-batch gradient: rank r holds rows r,
    r + ranks, ... of the global micro-batch (Lightning's DistributedSampler, in order)."""
    x, y = batch
    params = list(net.parameters())
    return sum(sum(g.double().square().sum() for g in torch.autograd.grad(
        _loss(net, (x[r::ranks], y[r::ranks])), params)) for r in range(ranks)) / ranks


def _own_loop(net, strategy, ranks=1):
    """Lightning's semantics: every window's losses divided by k (the short last window
    too, so its gradient is 2/3 of a mean); the noise scale from full windows only.
    `ranks`: the global micro-batch is `ranks` ranks' micro-batches, the small batch of
    the noise scale one rank's."""
    model = torch.nn.Module()
    model.net = net  # the parameter names LightningModule gives them
    optimizer = bigbatch.build_optimizer(model, strategy, data_degree=ranks)
    scheduler = bigbatch.build_scheduler(optimizer, strategy, STEPS, data_degree=ranks)
    gns = bigbatch.GradientNoiseScale()
    loader = _loader() if ranks == 1 else _ddp_order(ranks)
    for epoch in range(EPOCHS):
        if ranks > 1:
            loader.sampler.set_epoch(epoch)
        batches = list(loader)
        for start in range(0, BATCHES, K):
            window = batches[start:start + K]
            for i, batch in enumerate(window):
                if i == 0 and ranks > 1:
                    small = _shares_sq_norm(net, batch, ranks)
                (_loss(net, batch) / K).backward()
                if i == 0:
                    micro = [p.grad * K for p in net.parameters()]
            if len(window) == K and ranks > 1:
                big = sum(p.grad.double().square().sum() for p in net.parameters())
                gns.update(small, big, MICRO, MICRO * K * ranks)
            elif len(window) == K:
                gns.update_from_grads(micro, net, MICRO, MICRO * K)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return gns


def _rel(a, b):
    return max(float((x - y).detach().abs().max() / y.detach().abs().max())
               for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("strategy", [LAMB, LARS], ids=["lamb", "lars"])
def test_lightning_equals_own_loop(strategy):
    torch.manual_seed(0)
    net = _net()
    ref = copy.deepcopy(net)
    callback = NoiseScaleCallback()
    trainer = _fit(Module(net, strategy, STEPS), callback)
    gns = _own_loop(ref, strategy)
    assert trainer.global_step == STEPS
    assert _rel(net, ref) <= 1e-6
    assert callback.gns.steps == 2 * EPOCHS == gns.steps  # the short windows left out
    assert callback.gns.b_simple == pytest.approx(gns.b_simple, rel=1e-6)
    assert callback.gns.trace == pytest.approx(gns.trace, rel=1e-6)
    finite = [h["gns/b_simple"] for h in callback.history if math.isfinite(h["gns/b_simple"])]
    assert len(callback.history) == gns.steps and finite  # pl_module.log takes finite values
    assert float(trainer.callback_metrics["gns/b_simple"]) == pytest.approx(finite[-1], rel=1e-6)


def _ddp_fit(strategy, state):
    """One rank of a 2-rank Lightning DDP run (gloo): Lightning reads RANK, LOCAL_RANK,
    WORLD_SIZE and MASTER_* as torchrun sets them and makes the group itself."""
    net = _net()
    net.load_state_dict(state)
    callback = NoiseScaleCallback()
    trainer = _fit(Module(net, strategy, STEPS, ranks=2), callback, devices=2, strategy="ddp",
                   loader=_loader(MICRO, ranks=2))
    return {"weights": [p.detach().clone() for p in net.parameters()],
            "steps": trainer.global_step, "world": trainer.world_size,
            "b_simple": callback.gns.b_simple, "measured": callback.gns.steps}


@pytest.mark.parametrize("strategy", [LAMB, LARS], ids=["lamb", "lars"])
def test_two_ranks_equal_one_process(strategy):
    """Global batch 24 (accumulation 3) as 2 ranks x micro-batch 4 under Lightning's DDP
    (its own shuffling DistributedSampler), and as 1 process x micro-batch 8 over the
    same order: the same weights (1e-6) after the schedule's 6 steps; the noise scale
    every rank logs is the 2-rank loop's."""
    two = strategy.replace("global_batch_size = 12", "global_batch_size = 24")
    one = two.replace("micro_batch_size = 4", "micro_batch_size = 8")
    assert (bigbatch.Strategy.from_toml(two).resolve(2).peak_lr
            == bigbatch.Strategy.from_toml(one).resolve(1).peak_lr)
    torch.manual_seed(0)
    net = _net()
    ref, own = copy.deepcopy(net), copy.deepcopy(net)
    ranks = run_workers(_ddp_fit, 2, args=(two, net.state_dict()), timeout=240)
    _fit(Module(ref, one, STEPS), NoiseScaleCallback(), loader=_ddp_order(2))
    gns = _own_loop(own, two, ranks=2)
    for got in ranks:
        assert got["world"] == 2 and got["steps"] == STEPS
        net = _net()
        with torch.no_grad():
            for p, w in zip(net.parameters(), got["weights"], strict=True):
                p.copy_(w)
        assert _rel(net, ref) <= 1e-6 and _rel(net, own) <= 1e-6
        assert got["measured"] == gns.steps == 2 * EPOCHS
        assert got["b_simple"] == pytest.approx(gns.b_simple, rel=1e-6)


def test_batch_grows_between_epochs_and_resumes(tmp_path):
    """The rule's target (fraction x noise scale) far above the batch: at epoch 2's start
    the accumulation doubles (the global batch 12 -> 24, grow_to's ceiling), the LR x 2
    (linear); a run resumed from its checkpoint keeps accumulating 6."""
    torch.manual_seed(0)
    callback = NoiseScaleCallback(grow_to=24, noise_scale_fraction=1000, min_estimates=1)
    module = Module(_net(), LAMB, 100)
    trainer = _fit(module, callback, epochs=2, root=str(tmp_path))
    assert callback.changes and 1000 * callback.changes[0]["noise_scale"] >= 24
    assert trainer.accumulate_grad_batches == 2 * K
    assert [(c["old"], c["new"], c["lr_factor"]) for c in callback.changes] == [(12, 24, 2.0)]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.base_lrs == [pytest.approx(0.02)] * len(scheduler.base_lrs)
    ckpt = next(Path(tmp_path).rglob("*.ckpt"))
    again = NoiseScaleCallback(grow_to=24)
    resumed = _fit(Module(_net(), LAMB, 100), again, epochs=3, root=str(tmp_path / "r"),
                   ckpt=str(ckpt))
    assert resumed.accumulate_grad_batches == 2 * K and again.changes == callback.changes


def test_unset_fraction_follows_the_optimizers_family():
    """Left unset, the rule's fraction is bigbatch's for the optimizer's family: LAMB (Adam
    type: its defaults have betas) 0.0075, so a noise scale that 1000 x would grow on
    leaves the batch as it is."""
    torch.manual_seed(0)
    callback = NoiseScaleCallback(grow_to=24, min_estimates=1)
    trainer = _fit(Module(_net(), LAMB, 100), callback, epochs=2)
    assert callback.fraction == 0.0075
    assert 0.0075 * callback.gns.b_simple < 24 and not callback.changes
    assert trainer.accumulate_grad_batches == K


def test_lr_find_puts_the_module_back():
    torch.manual_seed(0)
    module = Module(_net(), LAMB, STEPS)
    before = copy.deepcopy(module.state_dict())
    optimizer = bigbatch.build_optimizer(module, LAMB, data_degree=1)
    lrs = [g["lr"] for g in optimizer.param_groups]
    found = lr_find(module, _loader(), optimizer, accumulate_grad_batches=2, lr_min=1e-4,
                    lr_max=1.0, steps=4)
    assert len(found.lrs) == 4 and found.lrs[0] == pytest.approx(1e-4)
    assert all(torch.equal(before[n], t) for n, t in module.state_dict().items())
    assert [g["lr"] for g in optimizer.param_groups] == lrs
    # the optimizer configure_optimizers returns, and a Strategy, work as well
    assert lr_find(module, _loader(), lr_min=1e-4, lr_max=1.0, steps=3).lrs
    assert lr_find(module, _loader(), LAMB, lr_min=1e-4, lr_max=1.0, steps=3).lrs


def test_docs_block_runs(tmp_path, monkeypatch):
    """docs/trainers.md's Lightning block, as printed."""
    from tests.test_docs_blocks import blocks

    monkeypatch.chdir(tmp_path)
    found = [b for b in blocks(ROOT / "docs" / "trainers.md")
             if "test_integrations_lightning" in b.reason]
    assert found, "docs/trainers.md has no block marked for this test"
    for block in found:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(block.code, block.id, "exec"), {})
