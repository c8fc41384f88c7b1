"""The gradient noise scale under pipeline parallelism (`bigbatch.engine.pipeline_gns`).

On 2 gloo ranks (GPipe, 1F1B, interleaved 1F1B), in float64, the small-batch norm
(micro-batch 0) and the big-batch norm (the whole step), summed over the stages, equal
the unsplit charlm Transformer's on the same rows, with the embedding tied to the LM
head across the two ends counted once; every step's estimate equals the single-process
run with gradient merge (which measures its first micro-step), AdamW's preconditioned
norms and AdaScale's gain included. Then the refusals, and the main job's metrics.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers

from bigbatch.config.parallelism import degrees
from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World
from bigbatch.tasks.charlm import CharLM

TINY = dict(seq_len=16, d_model=32, n_layer=2, n_head=4)
STEPS, K, GLOBAL = 4, 4, 16
MICRO = GLOBAL // K


def make_strategy(pipeline: dict | None, optimizer: str = "momentum",
                  lr: str = "none", merge_k: int = K) -> Strategy:
    """`pipeline` with `accumulate_steps` K, or (None) one process merging `merge_k`."""
    d: dict = {
        "batch": {"global_batch_size": GLOBAL, "base_batch_size": 4, "base_lr": 0.05,
                  "warmup_steps": 0, "scaling": "none"},
        "optimizer": {"type": optimizer, "weight_decay": 0.0, "epsilon": 1e-6},
        # Every step's estimate is compared, the first ones too (no estimator warm-up).
        "adaptive": {"noise_scale": True, "lr": lr, "gns_warmup_steps": 0},
    }
    if pipeline is None:
        d["gradient_merge"] = {"k_steps": merge_k}
    else:
        d["pipeline"] = {"accumulate_steps": K, **pipeline}
    return Strategy.from_dict(d)


def tokens():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 100, (STEPS, GLOBAL, TINY["seq_len"]), generator=g)
    y = torch.randint(0, 100, (STEPS, GLOBAL, TINY["seq_len"]), generator=g)
    y[torch.rand(y.shape, generator=g) < 0.2] = -100  # micro-batches of unequal token counts
    return x, y


def token_loss(logits, y):
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    return loss, (y != -100).sum()


def build(tie: bool = True):
    torch.manual_seed(0)
    return CharLM(**TINY, tie_weights=tie).build_model()


def record(run):
    """A grad hook keeping each step's (small |g|^2, big |g|^2, small batch, big batch)."""
    rows = []

    def hook(info):
        big = info.big_sq_norm if info.big_sq_norm is not None else info.global_sq_norm()
        rows.append((float(info.local_sq_norm), float(big), info.local_batch, info.global_batch))
    run.grad_hooks.append(hook)
    run.adaptive.estimate_log = []
    return rows


def _pipeline_worker(cases):
    from bigbatch.train.sharded import whole_model_state

    torch.set_default_dtype(torch.float64)
    out = {}
    for name, pipe, optimizer, lr in cases:
        run = prepare(build(), make_strategy(pipe, optimizer, lr), total_steps=STEPS)
        rows = record(run)
        x, y = tokens()
        for step in range(STEPS):
            run.pipeline_step(x[step], y[step], token_loss)
        out[name] = (rows, run.adaptive.estimate_log, run.stats,
                     whole_model_state(run.module, run.mesh, run.pipeline))
    run.set_batch(run.plan.micro_batch_size, run.k_steps)  # the same batch: allowed
    try:  # a policy that changes a pipeline's batch is stopped, naming why
        run.set_batch(run.plan.micro_batch_size, 2 * run.k_steps)
    except ConfigError as e:
        out["set_batch_error"] = str(e)
    return out


def _single(optimizer: str = "momentum", lr: str = "none"):
    """The unsplit model on one process, gradient merge over the same micro-batches."""
    run = prepare(build(), make_strategy(None, optimizer, lr), total_steps=STEPS, world=World())
    rows = record(run)
    x, y = tokens()
    for step in range(STEPS):
        for j in range(K):
            with run.micro_step() as ms:
                rows_j = slice(j * MICRO, (j + 1) * MICRO)
                ms.backward(*token_loss(run.model(x[step, rows_j]), y[step, rows_j]))
    return rows, run.adaptive.estimate_log, run.stats, run.module.state_dict()


CASES = [("gpipe", {"pp_degree": 2, "schedule_mode": "GPipe"}, "momentum", "none"),
         ("1f1b", {"pp_degree": 2, "schedule_mode": "1F1B"}, "momentum", "none"),
         ("interleaved", {"pp_degree": 2, "schedule_mode": "Interleaved1F1B",
                          "virtual_stages": 2}, "momentum", "none"),
         ("1f1b-adamw-adascale", {"pp_degree": 2}, "adamw", "adascale")]


def references(single) -> dict:
    """`single(optimizer, lr)`'s one-process runs in float64, by optimizer."""
    torch.set_default_dtype(torch.float64)
    try:
        return {"momentum": single(), "adamw": single("adamw", "adascale")}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def two_ranks():
    return references(_single), run_workers(_pipeline_worker, 2, (CASES,), timeout=240,
                                            init_group=True)


def _by_hand(tie: bool = True) -> tuple[float, float, float, float]:
    """Step 0's norms of the unsplit model: micro-batch 0's mean token gradient and the
    whole step's, from autograd on the plain model."""
    x, y = tokens()
    out = []
    for rows in (slice(0, MICRO), slice(0, GLOBAL)):
        model = build(tie)
        total, count = token_loss(model(x[0, rows]), y[0, rows])
        (total / count).backward()
        out += [sum(float(p.grad.square().sum()) for p in model.parameters()), float(count)]
    return out[0], out[2], out[1], out[3]


def test_step_0_norms_equal_the_unsplit_model(two_ranks):
    """Micro-batch 0's and the whole step's squared norms, summed over the two stages, are
    those of the unsplit model on the same rows (float64), on both ranks."""
    torch.set_default_dtype(torch.float64)
    try:
        want = _by_hand()
    finally:
        torch.set_default_dtype(torch.float32)
    _, ranks = two_ranks
    for case in ("gpipe", "1f1b", "interleaved"):
        for rank in ranks:
            assert rank[case][0][0] == pytest.approx(want, rel=1e-10), case


def test_tied_embedding_is_counted_once(two_ranks):
    """charlm's embedding and LM head share one weight, held by both ends: its micro-batch 0
    gradient is the sum of the two stages' parts, counted once. Counting each part on its
    holder would be the untied model's norm, which differs."""
    torch.set_default_dtype(torch.float64)
    try:
        untied = _by_hand(tie=False)
        tied = _by_hand()
    finally:
        torch.set_default_dtype(torch.float32)
    got = two_ranks[1][0]["1f1b"][0][0]
    assert got == pytest.approx(tied, rel=1e-10)
    assert abs(got[0] - untied[0]) > 1e-3 * got[0] and abs(got[1] - untied[1]) > 1e-3 * got[1]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_step_equals_the_single_process_merge(two_ranks, case):
    """Each step's norm pair, item counts and estimate, and the tracker's statistics, equal
    one process merging the same micro-batches (its first micro-step is the small batch);
    with AdamW the norms are preconditioned, and AdaScale's gains give the same weights."""
    single, ranks = two_ranks
    optimizer = "adamw" if "adamw" in case else "momentum"
    rows, log, stats, weights = single[optimizer]
    for rank in ranks:
        got_rows, got_log, got_stats, _ = rank[case]
        assert len(got_log) == len(log) == (STEPS - 1 if optimizer == "adamw" else STEPS)
        for got, want in zip(got_rows, rows, strict=True):
            assert got[2:] == want[2:]  # token counts: micro-batch 0's, the step's
            # One process reports its unpreconditioned big norm here; the log has both.
            n = 1 if optimizer == "adamw" else 2
            assert got[:n] == pytest.approx(want[:n], rel=1e-9)
        for got, want in zip(got_log, log, strict=True):
            assert got == pytest.approx(want, rel=1e-8)
        for key in ("gns", "gns_sq_norm", "gns_trace", "adascale_gain"):
            if key in stats:
                assert got_stats[key] == pytest.approx(stats[key], rel=1e-8), key
        assert got_stats["gns_biased"] == 0.0
    if optimizer == "adamw":
        assert stats["adascale_gain"] > 1.0
        got_weights = ranks[0][case][3]
        for name, w in got_weights.items():
            torch.testing.assert_close(w, weights[name], rtol=1e-9, atol=1e-12, msg=name)


# ---------------------------------------------------------------- refusals


PIPE = {"pipeline": {"pp_degree": 2, "accumulate_steps": 4}}


@pytest.mark.parametrize("extra, match", [
    ({"adaptive": {"batch_size": "goodput"}}, 'adaptive.batch_size="goodput" with'),
    ({"adaptive": {"policies": ["goodput"]}}, r'adaptive.policies=\["goodput"\] with'),
    ({"adaptive": {"policies": ["noise_scale_doubling"], "max_batch_size": 64}},
     r'adaptive.policies=\["noise_scale_doubling"\] with'),
    ({"adaptive": {"noise_scale": True},
      "pipeline": {"pp_degree": 2, "accumulate_steps": 4, "schedule_mode": "PipeDream"}},
     'pipeline.schedule_mode = "PipeDream"'),
    ({"adaptive": {"noise_scale": True}, "sharding": {"stage": 2}},
     r"adaptive.noise_scale=true with \[pipeline\] and \[sharding\]: each stage is then an "
     "FSDP2 module"),
    ({"adaptive": {"lr": "adascale"}, "batch": {"scaling": "none"}, "sharding": {"stage": 3}},
     r'adaptive.lr="adascale" with \[pipeline\] and \[sharding\]'),
    ({"adaptive": {"noise_scale": True}, "tensor_parallel": {"tensor_parallel_degree": 2}},
     r"\[adaptive\] with tensor parallelism"),
])
def test_refusals_name_the_key_in_one_line(extra, match):
    with pytest.raises(ConfigError, match=match) as err:
        Strategy.from_dict({**PIPE, **extra})
    assert "\n" not in str(err.value)


def test_pipeline_with_data_parallelism_is_accepted_without_sharding():
    """Pipeline x data: the stages are then DDP modules (`tests/test_pipeline_data_gns.py`);
    with [sharding] (FSDP2 stages) the strategy itself is refused, above."""
    s = Strategy.from_dict({**PIPE, "adaptive": {"noise_scale": True}})
    assert degrees(s, 2).pipeline == 2
    d = degrees(s, 4)
    assert (d.pipeline, d.data, d.stage) == (2, 2, 0)


def test_tracking_and_adascale_are_accepted():
    Strategy.from_dict({**PIPE, "adaptive": {"noise_scale": True}})
    Strategy.from_dict({**PIPE, "adaptive": {"lr": "adascale"}, "batch": {"scaling": "none"}})


# ---------------------------------------------------------------- the main job


def test_main_job_writes_the_noise_scale(tmp_path):
    from bigbatch.cli.main import main

    out = tmp_path / "run"
    code = main(["train", "--task", "charlm", "--nproc", "2", "--out", str(out), "--steps", "6",
                 "--no-progress", "--no-tensorboard", "--log-every", "1",
                 *[a for k, v in TINY.items() for a in ("--task-opt", f"{k}={v}")],
                 "--set", "pipeline.pp_degree=2", "--set", "pipeline.accumulate_steps=4",
                 "--set", "batch.global_batch_size=32", "--set", "batch.warmup_epochs=0",
                 "--set", "adaptive.noise_scale=true", "--set", "adaptive.gns_warmup_steps=0"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gns = [r["gns"] for r in rows if "gns" in r]
    assert gns and all(g == g for g in gns) and all(r["gns_biased"] == 0.0
                                                    for r in rows if "gns" in r)


def _shared_chunk_worker():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    model[2].weight = model[0].weight  # stages 0 and 2: both on rank 0 when interleaved
    s = Strategy.from_dict({"batch": {"global_batch_size": 4, "base_batch_size": 4},
                            "adaptive": {"noise_scale": True},
                            "pipeline": {"pp_degree": 2, "accumulate_steps": 2,
                                         "schedule_mode": "Interleaved1F1B", "virtual_stages": 2,
                                         "split_points": ["1", "2", "3"]}})
    try:
        prepare(model, s, total_steps=1)
    except ConfigError as e:
        return str(e)
    return None


def test_weight_shared_by_two_stages_of_one_rank_is_refused_on_every_rank():
    """Interleaved, a weight used by two stages of one rank gets micro-batch 0's gradient in
    two backwards: no first-accumulation hook can see it whole, so every rank refuses."""
    got = run_workers(_shared_chunk_worker, 2, (), timeout=120, init_group=True)
    assert all(m is not None and "'0.weight' is used by two stages of one rank" in m
               and "\n" not in m for m in got), got


def test_a_pipelines_batch_cannot_change_during_the_run(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        assert "under [pipeline]" in r["set_batch_error"] and "fixed for the run" in r["set_batch_error"]
