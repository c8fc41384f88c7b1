"""examples/gpt: the nanoGPT-style loop trains with both configs; k micro-steps with uneven
token counts are exactly one big-batch step (the README's claim); the corpus is
deterministic and read from disk; workers split each global batch without overlap."""

import socket
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `examples` is not an installed package

from examples.gpt import train as gpt  # noqa: E402
from examples.gpt.data import IGNORE_INDEX, CharCorpus, stdlib_files  # noqa: E402

TINY = {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}
CONFIGS = ROOT / "examples" / "gpt"


@pytest.fixture(scope="module")
def corpus():
    return CharCorpus(max_chars=300_000)


def _strategy(name: str, *overrides: str):
    return gpt.load_strategy(CONFIGS / f"{name}.toml", ["batch.warmup_steps=2", *overrides])


@pytest.mark.parametrize("name, overrides", [
    ("adamw_small", ()),
    # LAMB's 16x batch, scaled down: 64 sequences as 4 merged micro-steps of 16.
    ("lamb_16x", ("batch.global_batch_size=64", "batch.micro_batch_size=16")),
])
def test_a_few_steps_of_each_config_lower_the_loss(corpus, one_thread, name, overrides):
    s = _strategy(name, *overrides)
    r = gpt.train(s, corpus, steps=30, model_cfg=TINY, eval_blocks=32, log=lambda *a: None)
    assert r["steps"] == 30
    assert 0 < r["tokens"] <= r["positions"] == 30 * s.resolve(1).global_batch_size * 16
    assert torch.isfinite(torch.tensor(r["val_loss"]))
    # From about ln(vocab) ~ 4.6 nats at initialisation.
    assert r["val_loss"] < r["first_loss"] - 0.5, r


def _merged_run(corpus, name: str, micro: int, steps: int, mean_losses: bool = False):
    """`steps` optimizer steps of 8 uneven sequences each, as micro-batches of `micro`."""
    s = _strategy(name, "batch.global_batch_size=8", f"batch.micro_batch_size={micro}")
    run = gpt.build(s, corpus, steps, seed=0, model_cfg=TINY, dtype=torch.float64)
    x, y = corpus.ragged_blocks(8 * steps, TINY["block_size"])
    lrs = []
    for i in range(steps):
        xs, ys = x[8 * i:8 * i + 8].split(micro), y[8 * i:8 * i + 8].split(micro)
        if mean_losses:  # what a nanoGPT port does by habit: the mean of each micro-batch
            for xb, yb in zip(xs, ys, strict=True):
                with run.micro_step() as ms:
                    ms.backward(F.cross_entropy(run.model(xb).flatten(0, 1), yb.flatten(),
                                                ignore_index=IGNORE_INDEX))
        else:
            gpt.train_step(run, list(zip(xs, ys, strict=True)))
        lrs.append(run.last_lr)
    return run, (x, y), lrs


def _max_gap(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in
               zip(a.parameters(), b.parameters(), strict=True))


def test_uneven_micro_steps_are_one_big_batch_step(corpus, one_thread):
    steps = 3
    run, (x, y), lrs = _merged_run(corpus, "adamw_small", micro=2, steps=steps)
    counts = (y != IGNORE_INDEX).view(steps, 4, -1).sum(-1)
    assert counts.min() < 10 and counts.max() > 20, counts  # the micro-steps are uneven
    # The reference: plain torch, one AdamW step per 8 sequences on the token mean, with
    # the strategy's clipping, weight-decay rule and betas, at the LRs the run used.
    ref = gpt.build(_strategy("adamw_small"), corpus, steps, seed=0, model_cfg=TINY,
                    dtype=torch.float64).module
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    rest = [p for p in ref.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], betas=(0.9, 0.99), eps=1e-8)
    for i in range(steps):
        xb, yb = x[8 * i:8 * i + 8], y[8 * i:8 * i + 8]
        loss = F.cross_entropy(ref(xb).flatten(0, 1), yb.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        # max_grad_norm: g x 1 / max(|g|, 1) (torch's clip_grad_norm_ adds 1e-6 to |g|).
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
        for p in ref.parameters():
            p.grad.mul_(1.0 / max(float(norm), 1.0))
        for g in opt.param_groups:
            g["lr"] = lrs[i]
        opt.step()
        opt.zero_grad()
    assert _max_gap(run.module, ref) < 1e-12
    # The same micro-steps with mean losses are NOT the big-batch step: the gap the sum
    # and count close is many orders above float64 rounding.
    means, _, _ = _merged_run(corpus, "adamw_small", micro=2, steps=steps, mean_losses=True)
    assert _max_gap(means.module, ref) > 1e-6


@pytest.mark.parametrize("name", ["adamw_small", "lamb_16x"])
def test_the_readmes_merge_check(corpus, one_thread, name):
    s = _strategy(name, "batch.global_batch_size=8", "batch.micro_batch_size=8")
    r = gpt.check_merge(s, corpus, k=4, steps=2, model_cfg=TINY)
    assert r["min_tokens"] < 10 < 20 < r["max_tokens"], r
    assert r["count"] < 1e-12 and r["mean"] > 1e-6, r


def test_the_corpus_is_deterministic_and_needs_no_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the corpus touched the network")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    a, b = CharCorpus(max_chars=200_000), CharCorpus(max_chars=200_000)
    assert a.files == b.files and a.chars == b.chars and torch.equal(a.train.ids, b.train.ids)
    files = stdlib_files(200_000)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert files[0][1] == (stdlib / a.files[0]).read_text()
    assert a.decode(a.train.ids) == "".join(t for i, (_, t) in enumerate(files) if i % 10 != 9)
    assert a.decode(a.val.ids) == "".join(t for _, t in files[9::10])  # held-out files
    draw = [c.sample(torch.Generator().manual_seed(s), 8, 32) for c, s in ((a, 1), (b, 1), (a, 2))]
    assert all(torch.equal(p, q) for p, q in zip(draw[0], draw[1], strict=True))
    assert not torch.equal(draw[0][0], draw[2][0])
    assert torch.equal(a.val_blocks(16, 32)[1], b.val_blocks(16, 32)[1])


def test_a_block_never_crosses_into_the_next_file(corpus):
    split = corpus.train
    end = int(split.file_end[0])  # the first file's end
    x, y = split.blocks(torch.tensor([end - 5]), 16)
    assert (y[0, :4] != IGNORE_INDEX).all() and (y[0, 4:] == IGNORE_INDEX).all()
    assert (x[0, 5:] == 0).all() and torch.equal(x[0, 1:5], y[0, :4])


def test_workers_split_the_global_batch_without_overlap(corpus):
    def shares(world: int, micro: int):
        out = []
        for rank in range(world):
            fake = SimpleNamespace(
                plan=SimpleNamespace(global_batch_size=24, micro_batch_size=micro),
                k_steps=24 // (micro * world), mesh=SimpleNamespace(data_rank=rank),
                module=SimpleNamespace(cfg=SimpleNamespace(block_size=16)))
            step = next(gpt.batches(corpus, fake, seed=3))
            assert len(step) == fake.k_steps
            out += [x for x, _ in step]
        return torch.cat(out)

    one = shares(1, 24)
    assert torch.equal(shares(2, 4), one) and torch.equal(shares(3, 2), one)


def _train_tiny(steps: int) -> dict:
    """The example's loop for `steps` LAMB steps of 32 sequences; the final weights."""
    corpus = CharCorpus(max_chars=300_000)
    s = _strategy("lamb_16x", "batch.global_batch_size=32", "batch.micro_batch_size=8")
    run = gpt.build(s, corpus, steps, seed=0, model_cfg=TINY)
    data = gpt.batches(corpus, run, seed=0)
    while not run.done:
        gpt.train_step(run, next(data))
    weights = {k: v.detach().clone() for k, v in run.module.state_dict().items()}
    run.close()
    return weights


def test_two_workers_equal_one(one_thread):
    from _dist import run_workers

    one = _train_tiny(4)
    for two in run_workers(_train_tiny, world_size=2, args=(4,), timeout=120):
        for k in one:
            torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-5)
