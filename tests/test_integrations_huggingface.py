"""bigbatch.integrations.huggingface with the real transformers (skipped without it).

A Trainer run with bigbatch's optimizer, ScheduleLR and NoiseScaleCallback equals
bigbatch's own loop over the same micro-batches: the weights (float32, 1e-6 relative;
bitwise on one process where the arithmetic is the same) and the noise scale the callback
logs (the same `GradientNoiseScale` fed the same gradients), for a causal LM whose loss
the Trainer normalises by label tokens (Llama, GPT-2), for a model whose loss it divides
by the accumulation count, and on 2 gloo ranks. Tiny models from configs, random weights.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import bigbatch  # noqa: E402
from bigbatch.errors import ConfigError  # noqa: E402
from bigbatch.integrations.huggingface import NoiseScaleCallback, lr_find  # noqa: E402
from tests._dist import run_workers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

STRATEGY = """
[batch]
global_batch_size = 8
micro_batch_size = 4
base_batch_size = 8
base_lr = 0.01
warmup_steps = 2
decay = "cosine"
[optimizer]
type = "adamw"
[lamb]
[gradient_merge]
"""
MICRO, K, STEPS, SEQ, VOCAB = 4, 2, 5, 12, 64


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2,
                                  n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # else the Trainer counts labels[:, 0] too (see below)
    return model


class _Regressor(torch.nn.Module):
    """No **kwargs in forward: the Trainer divides its mean loss by the merge count."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _lm_data(n):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def _reg_data(n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return [{"x": r, "labels": r[:1] * 2 + 0.1} for r in x]


def _loss(model, rows):
    if "input_ids" in rows[0]:
        ids = torch.stack([r["input_ids"] for r in rows])
        return model(input_ids=ids, labels=ids).loss
    x = torch.stack([r["x"] for r in rows])
    return model(x, labels=torch.stack([r["labels"] for r in rows]))["loss"]


def _args(tmp, **kw):
    base = dict(output_dir=str(tmp), per_device_train_batch_size=MICRO,
                gradient_accumulation_steps=K, max_steps=STEPS, max_grad_norm=0.0,
                train_sampling_strategy="sequential", report_to="none", save_strategy="no",
                logging_steps=1, use_cpu=True, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


def _trainer_run(model, data, tmp, **kw):
    optimizer = bigbatch.build_optimizer(model, STRATEGY, data_degree=1)
    scheduler = bigbatch.build_scheduler(optimizer, STRATEGY, total_steps=STEPS, data_degree=1)
    callback = NoiseScaleCallback()
    trainer = transformers.Trainer(model=model, args=_args(tmp, **kw), train_dataset=data,
                                   optimizers=(optimizer, scheduler), callbacks=[callback])
    trainer.train()
    return trainer, callback


def _own_loop(model, data, ranks=1):
    """bigbatch's loop: k micro-batches per rank, mean loss / (k x ranks) (what DDP's
    average makes of the ranks' gradients); the noise scale from the first micro-batch
    (with several ranks: the mean squared norm of each rank's first one, accelerate
    dealing the batches round-robin) and the merged gradient."""
    optimizer = bigbatch.build_optimizer(model, STRATEGY, data_degree=1)
    scheduler = bigbatch.build_scheduler(optimizer, STRATEGY, total_steps=STEPS, data_degree=1)
    gns = bigbatch.GradientNoiseScale()
    per_step = MICRO * K * ranks
    for s in range(STEPS):
        rows = data[s * per_step:(s + 1) * per_step]
        micros = [rows[i:i + MICRO] for i in range(0, per_step, MICRO)]
        firsts = _first_norms(model, micros[:ranks]) if ranks > 1 else None
        for j, mb in enumerate(micros):
            (_loss(model, mb) / len(micros)).backward()
            if j == 0:  # .grad holds g_1 / k: keep k times a copy
                micro = [p.grad * len(micros) for p in model.parameters()]
        if firsts is None:
            gns.update_from_grads(micro, model, MICRO, per_step)
        else:
            big = sum(float(p.grad.double().square().sum()) for p in model.parameters())
            gns.update(sum(firsts) / ranks, big, MICRO, per_step)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return gns


def _first_norms(model, micros):
    """Squared norms of the mean gradients of `micros` at the model's present weights."""
    clone = copy.deepcopy(model)
    out = []
    for mb in micros:
        clone.zero_grad()
        _loss(clone, mb).backward()
        out.append(sum(float(p.grad.double().square().sum()) for p in clone.parameters()))
    return out


def _rel(a, b):
    return max(float((x - y).detach().abs().max() / y.detach().abs().max().clamp_min(1e-30))
               for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("make", [_llama, _gpt2, _Regressor], ids=["llama", "gpt2", "mean-loss"])
def test_trainer_equals_own_loop(make, tmp_path):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    data = (_reg_data if make is _Regressor else _lm_data)(MICRO * K * STEPS)
    trainer, callback = _trainer_run(model, data, tmp_path)
    gns = _own_loop(ref, data)
    assert _rel(model, ref) <= 1e-6
    assert callback.gns.steps == STEPS == gns.steps
    assert callback.gns.b_simple == pytest.approx(gns.b_simple, rel=1e-6)
    assert callback.gns.sq_norm == pytest.approx(gns.sq_norm, rel=1e-6)
    logged = trainer.state.log_history[STEPS - 1]
    assert logged["step"] == STEPS and logged["gns/b_simple"] == callback.gns.b_simple
    assert len(callback.history) == STEPS


def test_gpt2_label_count(tmp_path):
    """GPT-2 has loss_type None: the Trainer divides by every label token (12 a row where
    its shifted loss uses 11), so its gradient is 11/12 of the mean and LAMB's weights
    differ from the own loop's; the callback says so and names the fix
    (model.loss_type = "ForCausalLM", which test_trainer_equals_own_loop[gpt2] uses)."""
    torch.manual_seed(0)
    model = _gpt2()
    model.loss_type = None
    ref = copy.deepcopy(model)
    data = _lm_data(MICRO * K * STEPS)
    with pytest.warns(UserWarning, match="loss_type = 'ForCausalLM'"):
        _, callback = _trainer_run(model, data, tmp_path)
    _own_loop(ref, data)
    assert _rel(model, ref) > 1e-4
    assert callback.gns.steps == STEPS  # the scale cancels in the ratio: logged all the same


def test_clipped_steps_are_left_out(tmp_path):
    torch.manual_seed(0)
    model = _llama()
    with pytest.warns(UserWarning, match="clipped"):
        _, callback = _trainer_run(model, _lm_data(MICRO * K * STEPS), tmp_path,
                                   max_grad_norm=1e-3)
    assert callback.probe.clipped == STEPS and callback.gns.steps == 0


def test_one_micro_batch_warns(tmp_path):
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="gradient_accumulation_steps=1"):
        _, callback = _trainer_run(_llama(), _lm_data(MICRO * STEPS), tmp_path,
                                   gradient_accumulation_steps=1)
    assert callback.gns.steps == 0


def test_batch_schedule_is_refused():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        NoiseScaleCallback(batch_schedule="adaptive")


def test_lr_find_then_train_equals_own_loop(tmp_path):
    """The sweep puts model, optimizer and ScheduleLR back: the training after it equals
    the own loop that never swept."""
    torch.manual_seed(0)
    model = _llama()
    ref = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    data = _lm_data(MICRO * K * STEPS)
    optimizer = bigbatch.build_optimizer(model, STRATEGY, data_degree=1)
    scheduler = bigbatch.build_scheduler(optimizer, STRATEGY, total_steps=STEPS, data_degree=1)
    lrs = [g["lr"] for g in optimizer.param_groups]
    trainer = transformers.Trainer(model=model, args=_args(tmp_path), train_dataset=data,
                                   optimizers=(optimizer, scheduler))
    found = lr_find(trainer, lr_min=1e-4, lr_max=1.0, steps=STEPS)
    assert len(found.lrs) >= 2 and found.lrs[0] == pytest.approx(1e-4)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert [g["lr"] for g in optimizer.param_groups] == lrs
    assert scheduler.last_epoch == 0
    trainer.train()
    _own_loop(ref, data)
    assert _rel(model, ref) <= 1e-6


def _two_rank_worker(tmp):
    torch.manual_seed(0)
    model = _llama()
    data = _lm_data(MICRO * K * 2 * STEPS)
    _, callback = _trainer_run(model, data, Path(tmp))
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "gns": callback.gns.state_dict()}


def test_two_ranks_equal_one_process(tmp_path):
    """2 gloo ranks, accelerate dealing the sequential batches round-robin: the weights
    equal one process merging the same 4 micro-batches, and every rank logs the noise
    scale of the ranks' mean first-micro-batch norm and the all-reduced gradient."""
    results = run_workers(_two_rank_worker, world_size=2, args=(str(tmp_path),), timeout=120)
    torch.manual_seed(0)
    ref = _llama()
    gns = _own_loop(ref, _lm_data(MICRO * K * 2 * STEPS), ranks=2)
    for r in results:
        for got, want in zip(r["weights"], ref.parameters(), strict=True):
            assert float((got - want).abs().max() / want.abs().max()) <= 1e-6
        assert r["gns"]["steps"] == STEPS
        assert r["gns"]["ema_trace"] == pytest.approx(gns.state_dict()["ema_trace"], rel=1e-5)
        assert r["gns"]["ema_sq_norm"] == pytest.approx(gns.state_dict()["ema_sq_norm"],
                                                        rel=1e-5)


def test_docs_block_runs(tmp_path, monkeypatch):
    """docs/trainers.md's Trainer block, as printed."""
    monkeypatch.chdir(tmp_path)
    from tests.test_docs_blocks import blocks

    found = [b for b in blocks(ROOT / "docs" / "trainers.md")
             if "test_integrations_huggingface" in b.reason]
    assert found, "docs/trainers.md has no block marked for this test"
    for block in found:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            namespace: dict = {}
            exec(compile(block.code, block.id, "exec"), namespace)
