"""A user's own model through ZeRO-2/3 and tensor parallelism, on 2 gloo ranks.

The models are written the way Hugging Face writes them (`_hf_models`: nested
``model.layers`` / ``transformer.h``, untied heads, rotary embeddings passed to
every layer, ``Conv1D`` projections), and nothing of bigbatch's is private here:
`prepare` with the strategy, the user's tensor-parallel plan as a `ModelPlan`.

- ZeRO-3 makes every block an FSDP2 unit (found in the nested ``ModuleList``), and
  at most the root plus about one block is unsharded at any point of forward;
- after 10 steps the weights equal one process's (float32, 1e-5 of each tensor's
  norm) for stage 2,
  stage 3 and tensor parallel 2 with an untied vocabulary-parallel embedding (GPT-2's
  ``Conv1D`` MLP split by the transposed styles; BERT, whose attention views a fixed head
  count, through its plan's own `parallelize`);
- a plan entry that names no module is refused in one line naming it;
- `run.save_state` + `run.load_state` in the middle of a stage-3 run equals the run
  left alone, and the same state resumes in one process (DCP reshards it).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from _hf_models import (
    BERT_PLAN,
    GPT2_TP_PLAN,
    LLAMA_TP_PLAN,
    SEQ,
    D,
    full_state,
    gpt2_layers,
    llama_layers,
    make,
    token_batches,
)

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError, SaveStateError
from bigbatch.parallel.model_plan import ModelPlan
from bigbatch.parallel.world import World

W, STEPS, GLOBAL = 2, 10, 8
CASES = [("llama", "stage2"), ("llama", "stage3"), ("gpt2", "stage2"), ("gpt2", "stage3"),
         ("llama", "tp2"), ("gpt2", "tp2"), ("bert", "tp2"), ("llama", "pp2"), ("gpt2", "pp2")]
TP_PLANS = {"llama": LLAMA_TP_PLAN, "gpt2": GPT2_TP_PLAN}
LAYERS = {"llama": llama_layers, "gpt2": gpt2_layers}


def strategy(layout: str | None) -> Strategy:
    d: dict = {"batch": {"global_batch_size": GLOBAL, "base_batch_size": GLOBAL,
                         "base_lr": 0.01, "warmup_steps": 2, "decay": "cosine"},
               "optimizer": {"type": "adamw", "weight_decay": 0.0, "max_grad_norm": 1.0},
               "lamb": {"enable": True, "lamb_weight_decay": 0.01,
                        "exclude_from_weight_decay": ["bias", "norm", "ln_"]}}
    if layout in ("stage2", "stage3"):
        d["sharding"] = {"stage": int(layout[-1])}
    elif layout == "tp2":
        d["tensor_parallel"] = {"tensor_parallel_degree": 2}
    elif layout == "pp2":
        d["pipeline"] = {"pp_degree": 2, "accumulate_steps": 2}
    return Strategy.from_dict(d)


def tokens() -> torch.Tensor:
    return token_batches(STEPS, GLOBAL, SEQ)


def train(run, rows: slice, steps: range = range(STEPS), data: torch.Tensor | None = None,
          logits_of=lambda out: out) -> dict[str, torch.Tensor]:
    """`steps` steps on `rows` of each step's batch (`data`, default `tokens()`);
    `logits_of` takes the logits out of the model's output (HF: ``out.logits``)."""
    data = tokens() if data is None else data
    for step in steps:
        x, y = data[step, rows, :-1], data[step, rows, 1:]
        with run.micro_step() as ms:
            logits = logits_of(run.model(x))
            ms.backward(F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        assert ms.stepped
    return full_state(run.module)


def train_pipeline(run, data: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Every rank calls `pipeline_step` with the whole batch; the step divides the summed
    token loss by the global count, which is one process's mean loss. Returns this
    rank's stage's weights."""
    data = tokens() if data is None else data

    def loss(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"), y.numel()

    for step in range(len(data)):
        run.pipeline_step(data[step, :, :-1], data[step, :, 1:], loss)
    return full_state(run.module)


def unsharded_peak(run, x: torch.Tensor | None = None) -> float:
    """The largest share of the model's parameters held whole (not as DTensor shards) at
    any module's forward, over one forward pass."""
    from torch.distributed.tensor import DTensor

    model = run.module
    total = sum(p.numel() for p in model.parameters())
    peak = [0]

    def hook(_module, _args):
        whole = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
        peak[0] = max(peak[0], whole)

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()]
    with torch.no_grad():
        model(tokens()[0, :2, :-1] if x is None else x)
    for h in handles:
        h.remove()
    return peak[0] / total


def _worker(state_dir: str) -> dict:
    from torch.distributed.fsdp import FSDPModule

    rank = int(os.environ["RANK"])
    out = {}
    for name, layout in CASES:
        model = make(name)
        tp = BERT_PLAN if name == "bert" else ModelPlan(tp_plan=TP_PLANS.get(name))
        plan = tp if layout == "tp2" else (
            ModelPlan(pipeline_layers=LAYERS[name](model)) if layout == "pp2" else None)
        run = prepare(model, strategy(layout), total_steps=STEPS, model_plan=plan)
        if layout == "pp2":
            out[(name, layout)] = train_pipeline(run)
            continue
        if layout == "stage3":
            blocks = run.module.model.layers if name == "llama" else run.module.transformer.h
            out[(name, "units")] = [isinstance(b, FSDPModule) for b in blocks]
            out[(name, "peak")] = unsharded_peak(run)
        data_rank = rank if layout != "tp2" else 0
        per = GLOBAL // (W if layout != "tp2" else 1)
        out[(name, layout)] = train(run, slice(data_rank * per, (data_rank + 1) * per))
    # Stop after 5 steps, save, rebuild everything, load, finish: as if never stopped.
    rows = slice(rank * GLOBAL // W, (rank + 1) * GLOBAL // W)
    run = prepare(make("llama"), strategy("stage3"), total_steps=STEPS)
    train(run, rows, range(5))
    run.save_state(state_dir, extra={"next_step": 5})
    run = prepare(make("gpt2"), strategy(None), total_steps=STEPS)  # another model meanwhile
    run = prepare(make("llama"), strategy("stage3"), total_steps=STEPS)
    out["extra"] = run.load_state(state_dir)
    out["resumed"] = train(run, rows, range(out["extra"]["next_step"], STEPS))
    out["whole"] = run.whole_state_dict()
    out["failed"] = _save_fails_on_rank_1(run, state_dir, rank)
    return out


def _save_fails_on_rank_1(run, state_dir: str, rank: int):
    """A full disk on rank 1 alone: every rank raises, within seconds, naming rank 1;
    the state saved before stays whole (the tests below load it)."""
    import errno
    import time

    real = torch.save

    def full(obj, f, *a, **k):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)

    torch.save = full
    t0 = time.monotonic()
    try:
        run.save_state(state_dir, extra={"next_step": 99})
    except SaveStateError as e:
        return str(e), time.monotonic() - t0
    finally:
        torch.save = real
    return None


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("state") / "llama-stage3"


@pytest.fixture(scope="module")
def parallel(state_dir):
    return run_workers(_worker, world_size=W, args=(str(state_dir),), timeout=240,
                       init_group=True)


@pytest.fixture(scope="module")
def single():
    return {name: train(prepare(make(name), strategy(None), total_steps=STEPS, world=World()),
                        slice(0, GLOBAL)) for name in ("llama", "gpt2", "bert")}


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{n}-{lay}" for n, lay in CASES])
def test_user_model_equals_one_process(parallel, single, name, layout):
    """Each tensor within 1e-5 of one process's, relative to its norm (elementwise,
    Adam's direction on gradients that are rounding noise, ~1e-7, differs there)."""
    seen = set()
    for rank in range(W):
        got = parallel[rank][(name, layout)]
        seen |= set(got)
        assert set(got) <= set(single[name])  # a pipeline stage holds part of the model
        for key in got:
            ref = single[name][key]
            a, b = got[key], ref
            # A key bias's gradient is exactly 0 (softmax ignores a constant added to every
            # score), so Adam turns its rounding noise into full-size steps: left out (the
            # key part of GPT-2's fused c_attn bias, BERT's key.bias).
            if key.endswith("key.bias"):
                continue
            if key.endswith("c_attn.bias"):
                a, b = torch.cat([a[:D], a[2 * D:]]), torch.cat([b[:D], b[2 * D:]])
            err = float((a - b).norm() / b.norm().clamp_min(1e-12))
            assert err <= 1e-5, (key, err)
    assert seen == set(single[name])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_zero3_shards_every_nested_block(parallel, name):
    """The blocks in ``model.layers`` / ``transformer.h`` are FSDP2 units, so forward holds
    the root and about one block whole: measured 41 % (Llama) and 43 % (GPT-2) of these
    3-block models, where a root-only ZeRO-3 holds 100 %."""
    assert parallel[0][(name, "units")] == [True, True, True]
    peak = parallel[0][(name, "peak")]
    assert peak <= 0.45, peak


def test_misspelled_plan_entry_is_refused_naming_it():
    plan = dict(LLAMA_TP_PLAN)
    plan["model.layers.*.self_atn.q_proj"] = plan.pop("model.layers.*.self_attn.q_proj")
    with pytest.raises(ConfigError, match=r"'model\.layers\.\*\.self_atn\.q_proj' names no "
                                          r"module of Llama"):
        prepare(make("llama"), strategy("tp2"), total_steps=STEPS,
                world=World(rank=0, world_size=2), model_plan=ModelPlan(tp_plan=plan))


def _close(got, ref):
    for key, want in ref.items():
        err = float((got[key] - want).norm() / want.norm().clamp_min(1e-12))
        assert err <= 1e-5, (key, err)


def test_save_and_load_state_mid_run_under_stage3(parallel, single, state_dir):
    for rank in range(W):
        assert parallel[rank]["extra"] == {"next_step": 5}
        _close(parallel[rank]["resumed"], single["llama"])
        message, seconds = parallel[rank]["failed"]
        assert "failed on rank 1 (No space left on device)" in message and seconds < 30
    _close(parallel[0]["whole"], single["llama"])  # the unsplit model's, on rank 0
    assert sorted(p.name for p in state_dir.parent.iterdir()) == [state_dir.name]  # no temp


def test_a_two_rank_stage3_state_resumes_in_one_process(parallel, state_dir):
    run = prepare(make("llama"), strategy("stage3"), total_steps=STEPS, world=World())
    assert run.load_state(state_dir) == {"next_step": 5} and run.step == 5
    # The checkpoint's batch, on one worker: micro-batches of 4, merged in pairs.
    micro, k = run.plan.micro_batch_size, run.k_steps
    assert micro * k == GLOBAL
    data = tokens()
    for step in range(5, STEPS):
        for j in range(k):
            x = data[step, j * micro:(j + 1) * micro]
            with run.micro_step() as ms:
                logits = run.model(x[:, :-1])
                ms.backward(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))
    assert run.step == STEPS
    _close(full_state(run.module), parallel[0][("llama", "stage3")])


def test_save_state_never_replaces_a_directory_it_did_not_write(tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    run = prepare(make("llama"), strategy(None), total_steps=STEPS, world=World())
    with pytest.raises(ConfigError, match="exists and is not a state bigbatch wrote"):
        run.save_state(mine)
    assert [p.name for p in mine.iterdir()] == ["keep.txt"]
    train(run, slice(0, GLOBAL), range(3))
    run.save_state(tmp_path / "s", extra={"epoch": 1})
    run.save_state(tmp_path / "s", extra={"epoch": 2})  # its own: replaced whole
    again = prepare(make("llama"), strategy(None), total_steps=STEPS, world=World())
    assert again.load_state(tmp_path / "s") == {"epoch": 2} and again.step == 3
    _close(full_state(again.module), full_state(run.module))


def test_own_model_page_runs_as_written(tmp_path, monkeypatch):
    """docs/own-model.md's example (with `state_dir` given) runs as written."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "own-model.md").read_text()
    blocks = [code for skip, code in re.findall(r"(<!-- not-run[^\n]*\n)?```python\n(.*?)```",
                                                page, re.S) if not skip]
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        ns = {"state_dir": tmp_path / "state"}
        exec(compile(code, "docs/own-model.md", "exec"), ns)
        assert set(ns["weights"]) == set(ns["LM"]().state_dict())


def _failing_stage() -> dict:
    """Stage 1's third block raises; the user's code catches the error and meets a
    collective, as a loop that logs and goes on would."""
    import torch.distributed as dist

    from bigbatch.errors import PipelineError

    rank = int(os.environ["RANK"])
    model = make("llama")
    if rank == 1:
        def broken(x, *args):
            raise ValueError("mat1 and mat2 shapes cannot be multiplied (planted)")
        model.model.layers[2].forward = broken
    run = prepare(model, strategy("pp2"), total_steps=STEPS,
                  model_plan=ModelPlan(pipeline_layers=llama_layers(model)))
    data = tokens()
    try:
        run.pipeline_step(data[0, :, :-1], data[0, :, 1:], lambda out, y: (
            F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum"), y.numel()))
    except PipelineError as e:
        message = str(e)
    try:
        dist.barrier()
        after = "the barrier passed"
    except Exception as e:  # noqa: BLE001
        after = type(e).__name__
    return {"message": message, "after": after}


def test_a_failing_stage_is_named_on_every_rank_and_nobody_waits():
    """Both ranks raise one PipelineError naming stage 1, the layer and the error, within
    the spawn's 90 s (the group's own timeout is 300 s); a collective afterwards fails at
    once instead of waiting for the dead stage."""
    out = run_workers(_failing_stage, world_size=W, timeout=90, init_group=True)
    want = ("pipeline stage 1 of 2, layer 'model.layers.2': ValueError: mat1 and mat2 shapes "
            "cannot be multiplied (planted)")
    assert out[1]["message"] == want
    assert out[0]["message"] == want + "; stage 0 stopped with it"
    assert [o["after"] for o in out] == ["ValueError", "ValueError"]  # no group left


def test_a_model_plan_can_replace_parallelize():
    """`ModelPlan(parallelize=...)` is called instead of bigbatch's, with the same
    arguments (here: recording them, then laying out as bigbatch would)."""
    from bigbatch.engine.parallelize import parallelize

    seen = []

    def mine(module, mesh, strategy, plan, **kw):
        seen.append((type(module).__name__, plan.blocks, sorted(kw)))
        return parallelize(module, mesh, strategy, plan, **kw)

    run = prepare(make("llama"), strategy(None), total_steps=STEPS, world=World(),
                  model_plan=ModelPlan(blocks=("LlamaDecoderLayer",), parallelize=mine))
    assert seen == [("Llama", ("LlamaDecoderLayer",), ["fsdp", "param_dtype", "stage_of"])]
    train(run, slice(0, GLOBAL), range(1))
