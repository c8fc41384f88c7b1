"""The plan equals real gloo runs: per-rank bytes as `benchmarks/memory.py` measures them
(parameters, gradients at the optimizer step, optimizer state: local shards, storages
counted once) and the bytes each step hands to every collective, by mesh dimension,
counted with the planner's own counter around `prepare()`'s real run.

One worker process per rank runs all layouts one after another (spawning is the slow
part on this machine); the plan of each layout is made in the test process.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from bigbatch.config.strategy import Strategy
from bigbatch.optim._norms import local
from bigbatch.planner import plan
from bigbatch.tasks.charlm import TENSOR_PARALLEL_PLAN, CharTransformer
from tests._dist import run_workers

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ, MICRO = 96, 16, 4


def _model() -> CharTransformer:
    return CharTransformer(VOCAB, SEQ, d_model=32, n_layer=2, n_head=2)


def _strategy(mode: str, k: int, world: int) -> Strategy:
    """`mode`: "+"-joined parts: ddp, zero1-3, tp2, pp2; muon (else LAMB)."""
    parts = mode.split("+")
    tensor = 2 if "tp2" in parts else 1
    stages = 2 if "pp2" in parts else 1
    data = world // (tensor * stages)
    d = {"batch": {"global_batch_size": MICRO * k * data, "base_batch_size": 4,
                   "base_lr": 1e-3},
         "optimizer": {"type": "adamw", "weight_decay": 0.0},
         "muon" if "muon" in parts else "lamb": {}}
    if stages > 1:
        d["pipeline"] = {"pp_degree": stages, "accumulate_steps": k}
    elif k > 1:
        d["gradient_merge"] = {"enable": True, "k_steps": k}
    if tensor > 1:
        d["tensor_parallel"] = {"tensor_parallel_degree": tensor}
    for part in parts:
        if part.startswith("zero"):
            d["sharding"] = {"stage": int(part[-1])}
    return Strategy.from_dict(d)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _measure(layouts: list[tuple[str, int]]) -> dict:
    """On each rank: every layout's bytes at the optimizer step and the collectives of its
    first step after the unused-parameter check."""
    import os

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from bigbatch.engine.prepare import prepare
    from bigbatch.parallel.unused_params import CHECKED_STEPS
    from bigbatch.planner.counting import CommCount, counting, dims_of

    world = int(os.environ["WORLD_SIZE"])
    out, known = {}, {}
    for mode, k in layouts:
        torch.manual_seed(0)
        strategy = _strategy(mode, k, world)
        run = prepare(_model(), strategy, total_steps=10,
                      tp_plan=TENSOR_PARALLEL_PLAN if "tp2" in mode else None)
        if run.comm is None and hasattr(run.model, "register_comm_hook"):
            # The default all-reduce as a Python hook, so that the counter sees it.
            run.model.register_comm_hook(None, allreduce_hook)
        names = dims_of(run.mesh)
        for _, group in getattr(run.pipeline, "tied", ()):
            names.setdefault(group.group_name, "pp")
        # DTensor caches sharding decisions by mesh equality (ranks and dim names), so a
        # layout may reuse an earlier layout's equal mesh and its (live) groups.
        known.update(names)
        names = {**known, **names}
        held: dict = {}

        def at_step(opt, args, kwargs, run=run, held=held):
            params = list(run.module.parameters())
            inner = getattr(run.optimizer, "optim", run.optimizer)
            held.update(params=_bytes(params),
                        grads=_bytes(p.grad for p in params if p.grad is not None),
                        optimizer=_bytes(v for s in inner.state.values() for v in s.values()
                                         if isinstance(v, torch.Tensor)))

        run.optimizer.register_step_pre_hook(at_step)
        gen = torch.Generator().manual_seed(1)
        plan_ = run.plan
        # the collectives of the step after FSDP2's unused-parameter check (its first
        # CHECKED_STEPS steps exchange where each rank is): the plan is of the steady step
        for _step in range(CHECKED_STEPS + 1):
            count = CommCount()
            with counting(count, names):
                if run.pipeline is not None:
                    x = torch.randint(0, VOCAB, (plan_.micro_batch_size * plan_.k_steps, SEQ),
                                      generator=gen)
                    run.pipeline_step(x, x, lambda o, y: (_loss(o, y), y.numel()))
                else:
                    for _ in range(plan_.k_steps):
                        x = torch.randint(0, VOCAB, (plan_.micro_batch_size, SEQ),
                                          generator=gen)
                        with run.micro_step() as ms:
                            ms.backward(_loss(run.model(x), x), count=x.numel())
        out[f"{mode}/{k}"] = {**held, "comm": count.bytes}
        run.close()
        del run
        gc.collect()
    return out


def _plan(mode: str, k: int, world: int):
    return plan(_model, _strategy(mode, k, world), world, loss=_loss,
                example=lambda b: (torch.zeros(b, SEQ, dtype=torch.long),) * 2,
                tp_plan=TENSOR_PARALLEL_PLAN if "tp2" in mode else None)


def _check(layouts: list[tuple[str, int]], world: int, measured: list[dict]) -> None:
    for mode, k in layouts:
        planned = _plan(mode, k, world)
        for simulated in planned.ranks:
            real = measured[simulated.rank][f"{mode}/{k}"]
            where = f"{mode} k={k} rank {simulated.rank}"
            assert (simulated.params, simulated.grads) == (real["params"], real["grads"]), where
            if planned.degrees.zero1_enabled:  # the plan's is the fullest rank's partition
                fullest = max(m[f"{mode}/{k}"]["optimizer"] for m in measured)
                assert simulated.optimizer == fullest, where
            else:
                assert simulated.optimizer == real["optimizer"], where
            assert simulated.comm.bytes == real["comm"], where


WORLD2 = [("ddp", 1), ("ddp", 2), ("zero1", 1), ("zero2", 2), ("zero3", 1), ("zero3", 2),
          ("tp2", 2), ("pp2", 2), ("pp2", 4),
          # Muon: ZeRO-1's partition of its groups; the two all-to-alls of whole matrices
          # (ZeRO-2/3, TP), once a step whatever the merge; under DDP the all-gather of
          # each replica's orthogonalised matrices.
          ("zero1+muon", 1), ("zero3+muon", 2), ("tp2+muon", 1), ("ddp+muon", 1),
          ("ddp+muon", 2)]


def test_plan_equals_two_gloo_ranks():
    measured = run_workers(_measure, world_size=2, args=(WORLD2,), timeout=300, init_group=True)
    _check(WORLD2, 2, measured)


WORLD4 = [("pp2+zero3", 2), ("tp2", 1), ("tp2+zero3", 2),
          ("tp2+zero3+muon", 1),  # Muon gathers each 2-D sharded matrix whole
          # Muon's owners over tp, shared over the data replicas; DDP's all-gather over 4
          ("tp2+muon", 1), ("ddp+muon", 2)]


@pytest.mark.slow
def test_plan_equals_four_gloo_ranks():
    measured = run_workers(_measure, world_size=4, args=(WORLD4,), timeout=600, init_group=True)
    _check(WORLD4, 4, measured)
