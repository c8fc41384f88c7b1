"""`tensor_parallel.tensor_init_seed` (Fleet's `tensor_parallel_configs.tensor_init_seed`):
the model's initial weights come from it whatever the tensor-parallel degree: the full
(gathered) weights of a 2-rank split equal one process's, and --seed still drives the rest."""

from __future__ import annotations

import pytest
import torch
from _dist import run_workers

from bigbatch.config.strategy import Strategy
from bigbatch.tasks import get_task
from bigbatch.train.plan import build_model

TASK = dict(seq_len=16, d_model=32, n_layer=2, n_head=4)


def _strategy(degree: int, init_seed: int | None) -> Strategy:
    tp = {"tensor_parallel_degree": degree}
    if init_seed is not None:
        tp["tensor_init_seed"] = init_seed
    return Strategy.from_dict({"tensor_parallel": tp, "batch": {"global_batch_size": 8,
                                                                "micro_batch_size": 8}})


def _initial(degree: int, init_seed: int | None, seed: int):
    """What the trainer does up to the first step: build, lay out; then the full weights."""
    from bigbatch.engine import prepare
    from bigbatch.parallel.tensor_parallel import unpadded_state_dict

    torch.set_num_threads(1)
    task = get_task("charlm", **TASK)
    strategy = _strategy(degree, init_seed)
    model = build_model(task, None, seed, strategy)
    after = torch.rand(3)  # the global RNG after the build: the run's --seed
    run = prepare(model, strategy, total_steps=1, model_plan=task.model_plan(model))
    return unpadded_state_dict(run.module), after


@pytest.mark.slow  # ~15 s: 2 spawned gloo ranks build and split the charlm model
def test_tp2_initial_weights_equal_one_process():
    (split, after), _ = run_workers(_initial, 2, args=(2, 7, 3), timeout=120, init_group=True)
    one, _ = _initial(1, None, 7)  # one process seeded 7 by --seed
    assert split.keys() == one.keys()
    for k in one:
        assert torch.equal(split[k], one[k]), k
    torch.manual_seed(3)  # the stream after the build is the run's seed, not the init seed
    assert torch.equal(after, torch.rand(3))
    other, _ = _initial(1, None, 3)
    assert not torch.equal(other["tok_emb.weight"], one["tok_emb.weight"])
