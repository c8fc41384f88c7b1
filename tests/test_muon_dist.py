"""[muon] however the model is split: 2 and 4 gloo ranks equal one process.

A Llama written as Hugging Face writes it (`_hf_models`: nested ``model.layers``, untied
``lm_head``, ``embed_tokens``) trains 10 steps under DDP, ZeRO-1, ZeRO-2, ZeRO-3, tensor
parallel 2 and pipeline 2, each with gradient merge k = 1 and k = 4 (the pipeline's
micro-batches), and every weight equals one process taking one step of the whole batch
(float32, relative to each tensor's norm; `WORST` records the largest error per layout).
Muon's matrices are orthogonalised whole: FSDP2 row shards and tensor-parallel column /
row slices go to owner ranks and come back (`bigbatch.optim.whole_matrices`), checked
also on uneven shards directly; DDP's replicas each orthogonalise their share of the
matrices and all-gather the results (one all-gather a step; `Muon.ns_work` no rank above
1.2x the mean). On 4 ranks (slow): DDP, data 2 x tensor parallel 2 (owners on the tensor
dimension, shared over the data replicas), HSDP (ZeRO-3 over 2 of 4: the same with row
shards) and tensor parallel 2 x ZeRO-3 (both dimensions sharded: gathered whole).
All 2-rank cases share one start of two processes, all 4-rank cases one of four.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import CountCalls, run_workers
from _hf_models import LLAMA_TP_PLAN, full_state, llama_layers, make, token_batches

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.parallel.model_plan import ModelPlan
from bigbatch.parallel.world import World

W, STEPS, GLOBAL, SEQ = 2, 10, 16, 8
LAYOUTS = ("ddp", "zero1", "zero2", "zero3", "tp2", "pp2")
# A pipeline of 2 stages needs >= 2 micro-batches: its k = 2 stands for "no merge".
# ddp_alone: [muon] spread_ns = false, every replica orthogonalises every matrix.
CASES = [(layout, k) for layout in LAYOUTS for k in ((2, 4) if layout == "pp2" else (1, 4))]
CASES.append(("ddp_alone", 1))
TOLERANCE = 1e-6  # relative to each tensor's norm, float32


def strategy(layout: str | None, k: int = 1) -> Strategy:
    d: dict = {"batch": {"global_batch_size": GLOBAL, "base_batch_size": GLOBAL,
                         "base_lr": 0.01, "warmup_steps": 2, "decay": "cosine"},
               "optimizer": {"type": "adamw", "weight_decay": 0.0},
               "muon": {"muon_weight_decay": 0.1, "spread_ns": layout != "ddp_alone"}}
    if k > 1 and layout != "pp2":
        d["gradient_merge"] = {"k_steps": k}
    if layout in ("zero1", "zero2", "zero3"):
        d["sharding"] = {"stage": int(layout[-1])}
    elif layout == "hsdp":  # ZeRO-3 over 2 ranks of each data replica
        d["sharding"] = {"stage": 3, "sharding_degree": 2}
    elif layout == "tp2":
        d["tensor_parallel"] = {"tensor_parallel_degree": 2}
    elif layout == "tp2xzero3":
        d["tensor_parallel"] = {"tensor_parallel_degree": 2}
        d["sharding"] = {"stage": 3}
    elif layout == "pp2":
        d["pipeline"] = {"pp_degree": 2, "accumulate_steps": k}
    return Strategy.from_dict(d)


def tokens() -> torch.Tensor:
    return token_batches(STEPS, GLOBAL, SEQ)


def train(run, k: int) -> dict[str, torch.Tensor]:
    data = tokens()
    if run.pipeline is not None:
        def loss(logits, y):
            return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"), y.numel()

        for step in range(STEPS):
            run.pipeline_step(data[step, :, :-1], data[step, :, 1:], loss)
        return full_state(run.module)
    degree, rank = run.mesh.data_degree, run.mesh.data_rank
    micro = GLOBAL // (k * degree)
    for step in range(STEPS):
        for j in range(k):
            start = (j * degree + rank) * micro
            x, y = data[step, start:start + micro, :-1], data[step, start:start + micro, 1:]
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x).flatten(0, 1), y.flatten()))
        assert ms.stepped
    return full_state(run.module)


def _uneven_shards() -> list[float]:
    """`apply_whole` on DTensors cut unevenly (7 rows, 7 columns over 2 ranks; a 1-row
    matrix whose second piece is empty), a replicated one and plain tensors split over
    replicas, against fn on the whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from bigbatch.optim.muon import newton_schulz
    from bigbatch.optim.whole_matrices import apply_whole

    mesh = init_device_mesh("cpu", (W,))
    g = torch.Generator().manual_seed(1)
    wholes = [torch.randn(7, 5, generator=g), torch.randn(5, 7, generator=g),
              torch.randn(3, 9, generator=g), torch.randn(1, 4, generator=g)]
    placements = [Shard(0), Shard(1), Replicate(), Shard(0)]
    params = [distribute_tensor(t, mesh, [p]) for t, p in zip(wholes, placements, strict=True)]
    got = apply_whole(lambda ts: [newton_schulz(t) for t in ts],
                      [p.to_local() for p in params], params)
    errs = []
    for t, p, piece in zip(wholes, params, got, strict=True):
        want = distribute_tensor(newton_schulz(t), mesh, p.placements).to_local()
        assert piece.shape == want.shape
        errs.append(float((piece - want).abs().max()) if want.numel() else 0.0)
    # Plain replicas (DDP's): an empty matrix, and a dtype whose one matrix leaves a rank
    # nothing to do (it sends padding).
    plain = [torch.randn(5, 3, generator=g), torch.randn(0, 4),
             torch.randn(4, 6, generator=g, dtype=torch.float64)]
    shared = apply_whole(lambda ts: [newton_schulz(t) for t in ts], plain, plain,
                         replicas=torch.distributed.group.WORLD)
    for t, piece in zip(plain, shared, strict=True):
        assert piece.shape == t.shape and piece.dtype == t.dtype
        errs.append(float((piece - newton_schulz(t)).abs().max()) if t.numel() else 0.0)
    return errs


def _worker(cases=None) -> dict:
    out = {} if cases else {"uneven": _uneven_shards()}
    for layout, k in cases or CASES:
        model = make("llama")
        plan = (ModelPlan(tp_plan=LLAMA_TP_PLAN) if layout.startswith("tp2") else
                ModelPlan(pipeline_layers=llama_layers(model)) if layout == "pp2" else None)
        run = prepare(model, strategy(layout, k), total_steps=STEPS, model_plan=plan)
        try:
            with CountCalls(("all_to_all_single",)) as moves, \
                    CountCalls(("all_gather_single", "all_gather_into_tensor")) as gathers:
                out[(layout, k)] = (train(run, k), type(run.optimizer).__name__)
            out[(layout, k, "moves")] = moves.calls
            out[(layout, k, "gathers")] = gathers.calls
            if hasattr(run.optimizer, "ns_work"):
                out[(layout, k, "ns_work")] = run.optimizer.ns_work()
        except Exception as e:
            raise RuntimeError(f"{layout} k={k}: {type(e).__name__}: {e}") from e
    return out


@pytest.fixture(scope="module")
def parallel():
    return run_workers(_worker, world_size=W, timeout=300, init_group=True)


@pytest.fixture(scope="module")
def four_ranks():
    return run_workers(_worker, world_size=4, args=(FOUR,), timeout=400, init_group=True)


@pytest.fixture(scope="module")
def single():
    run = prepare(make("llama"), strategy(None), total_steps=STEPS, world=World())
    return train(run, 1), run.optimizer


WORST: dict = {}
FOUR = [(layout, k) for layout in ("ddp", "tp2", "hsdp", "tp2xzero3") for k in (1, 4)]


def test_strategy_builds_muon_with_adamw_for_embeddings_head_norms(single):
    _, opt = single
    kinds: dict = {True: set(), False: set()}
    for g in opt.param_groups:
        kinds[g["use_muon"]] |= set(g["param_names"])
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= kinds[False]
    assert "model.layers.0.self_attn.q_proj.weight" in kinds[True]
    assert all(n.endswith("proj.weight") for n in kinds[True]) and len(kinds[True]) == 21


def test_uneven_row_and_column_shards_are_orthogonalised_whole(parallel):
    for rank in range(W):
        assert max(parallel[rank]["uneven"]) <= 1e-6, parallel[rank]["uneven"]


@pytest.mark.parametrize("case", CASES, ids=[f"{lay}-k{k}" for lay, k in CASES])
def test_layout_equals_one_process_step_of_the_whole_batch(parallel, single, case):
    _assert_equal(parallel, single, case)


@pytest.mark.slow  # 4 more processes on 2 cores (the default run keeps 2 ranks)
@pytest.mark.parametrize("case", FOUR, ids=[f"{lay}-k{k}" for lay, k in FOUR])
def test_layout_on_4_ranks_equals_one_process(four_ranks, single, case):
    """tp2 here is data 2 x tensor 2; tp2xzero3 has both mesh dims sharded (FSDP2's
    _StridedShard over TP's Shard): gathered whole, on each data replica."""
    _assert_equal(four_ranks, single, case)


def _assert_equal(parallel, single, case):
    want, _ = single
    seen: set = set()
    worst = 0.0
    for rank in range(len(parallel)):
        got, kind = parallel[rank][case]
        assert kind == ("ZeroRedundancyOptimizer" if case[0] == "zero1" else "Muon")
        assert set(got) <= set(want)
        seen |= set(got)
        for key, w in got.items():
            err = float((w - want[key]).norm() / want[key].norm().clamp_min(1e-12))
            worst = max(worst, err)
            assert err <= TOLERANCE, (key, err)
    assert seen == set(want)
    # FSDP2's rows and tensor-parallel slices: to the owners and back, once per step.
    sliced = case[0] in ("zero2", "zero3", "tp2", "hsdp")  # tp2 x zero3: gathered
    assert parallel[0][(*case, "moves")] == (2 * STEPS if sliced else 0)
    ranks = len(parallel)
    if case[0].startswith("ddp"):  # each replica's share to all: one all-gather a step
        assert parallel[0][(*case, "gathers")] == (STEPS if case[0] == "ddp" else 0)
    # Ranks the Newton-Schulz work is split over: TP x ZeRO-3 gathers on every rank.
    split = {"ddp": ranks, "tp2": ranks, "hsdp": ranks, "zero2": ranks, "zero3": ranks,
             "tp2xzero3": 1, "ddp_alone": 1}.get(case[0])
    line = f"muon {case[0]} k={case[1]} on {ranks} ranks: worst relative error {worst:.2e}"
    if split is not None:
        work = parallel[0][(*case, "ns_work")]
        assert len(work) == split and max(work) <= 1.2 * sum(work) / split, work
        line += f", Newton-Schulz work max/mean {max(work) * split / sum(work):.3f}"
    WORST[case] = worst
    print(line)
