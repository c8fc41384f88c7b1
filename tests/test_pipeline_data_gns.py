"""The noise scale under pipeline 2 x data 2 (`bigbatch.engine.pipeline_gns` with DDP stages).

Without `[sharding]`, a pipeline with a data degree above 1 and `[adaptive]` wraps each
stage in DDP over the data group, so every data rank's micro-batch 0 gradient reaches its
stage's parameters before the step's all-reduce. What the run measures, per step:

- small: the mean over the W data ranks of |g_d|^2, g_d the mean token gradient of data
  rank d's micro-batch 0 (summed over the stages, the tied embedding counted once), with
  small batch the mean of those micro-batches' token counts (as plain DDP reports its
  workers' mean); each g_d is one sample of a micro-batch gradient, so the mean is the
  same estimator over W samples;
- big: the step's gradient over all ``micro x k x W`` rows.

The single-process reference merges the same rows in data-rank order (data rank d's
micro-batch j is micro-step ``d k + j``) and replaces its own small norm (micro-step 0
alone) by the mean of micro-steps 0 and k, taken from autograd hooks on the unsplit
model: norms, counts, estimates, AdaScale's gains and the weights agree (float64).
Then the main job: DDP stages train as one process does, resume exactly, write `gns`.
"""

from __future__ import annotations

import json

import pytest
import torch
from _dist import run_workers
from test_pipeline_gns import CASES, TINY, build, record, references, token_loss, tokens
from test_pipeline_gns import make_strategy as gns_strategy
from test_sharded_train import STRATEGY

from bigbatch.config.strategy import Strategy
from bigbatch.engine.local_norms import preconditioned_grads
from bigbatch.engine.prepare import prepare
from bigbatch.parallel.world import World

STEPS, K, W, GLOBAL = 4, 4, 2, 16
MICRO = GLOBAL // (K * W)
LOCAL = GLOBAL // W  # rows per data rank and step


def make_strategy(pipeline: dict | None, optimizer: str = "momentum",
                  lr: str = "none") -> Strategy:
    """The pipeline-only test's strategy; the one-process reference merges all W x K."""
    return gns_strategy(pipeline, optimizer, lr, merge_k=K * W)


def _worker(cases):
    from torch.nn.parallel import DistributedDataParallel

    from bigbatch.train.sharded import whole_model_state

    torch.set_default_dtype(torch.float64)
    out = {}
    for name, pipe, optimizer, lr in cases:
        run = prepare(build(), make_strategy(pipe, optimizer, lr), total_steps=STEPS)
        assert all(isinstance(c, DistributedDataParallel) for c in run.pipeline._train_chunks)
        assert not isinstance(run.module, DistributedDataParallel)
        rows = record(run)
        d = run.mesh.data_rank
        x, y = tokens()
        mine = slice(d * LOCAL, (d + 1) * LOCAL)
        for step in range(STEPS):
            run.pipeline_step(x[step, mine], y[step, mine], token_loss)
        out[name] = (rows, run.adaptive.estimate_log, run.stats,
                     whole_model_state(run.module, run.mesh, run.pipeline),
                     sorted(run.module.state_dict()))
    return out


def _single(optimizer: str = "momentum", lr: str = "none"):
    """The unsplit model, merging the same micro-batches in data-rank order; its small norm
    is the mean over the data ranks' micro-batch 0 (micro-steps 0 and K)."""
    run = prepare(build(), make_strategy(None, optimizer, lr), total_steps=STEPS, world=World())
    params = [p for p in run.module.parameters() if p.requires_grad]
    caught: dict[int, list[torch.Tensor]] = {}
    now = [0]
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: caught.setdefault(now[0], [None] * len(params))
                        .__setitem__(i, g.detach().clone()) if now[0] % K == 0 else None)
    counts: list[float] = []

    def small_of_data_ranks(info):
        norms = []
        for d in range(W):
            grads = [g / (run.window.count_mult * counts[d]) for g in caught[d * K]]
            if optimizer == "adamw":
                grads = preconditioned_grads(run.optimizer, params, grads)
            norms.append(sum(float(g.square().sum()) for g in grads))
        info._local_sq = torch.tensor(sum(norms) / W)
        info.local_batch = sum(counts) / W
    run.grad_hooks.insert(0, small_of_data_ranks)
    rows = record(run)
    x, y = tokens()
    for step in range(STEPS):
        caught.clear()
        counts.clear()
        for now[0] in range(K * W):
            r = slice(now[0] * MICRO, (now[0] + 1) * MICRO)
            if now[0] % K == 0:
                counts.append(float((y[step, r] != -100).sum()))
            with run.micro_step() as ms:
                ms.backward(*token_loss(run.model(x[step, r]), y[step, r]))
    return rows, run.adaptive.estimate_log, run.stats, run.module.state_dict()


@pytest.fixture(scope="module")
def four_ranks():
    return references(_single), run_workers(_worker, 4, (CASES,), timeout=300,
                                            init_group=True)


def test_reference_small_norm_is_not_micro_step_0_alone(four_ranks):
    """The check below has teeth: data rank 1's micro-batch 0 moves the mean."""
    single, _ = four_ranks
    torch.set_default_dtype(torch.float64)
    try:
        plain = prepare(build(), make_strategy(None), total_steps=STEPS, world=World())
        first = record(plain)
        x, y = tokens()
        for j in range(K * W):
            with plain.micro_step() as ms:
                r = slice(j * MICRO, (j + 1) * MICRO)
                ms.backward(*token_loss(plain.model(x[0, r]), y[0, r]))
    finally:
        torch.set_default_dtype(torch.float32)
    assert abs(first[0][0] - single["momentum"][0][0][0]) > 1e-3 * first[0][0]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_step_equals_the_single_process_merge(four_ranks, case):
    """Each step's norm pair, token counts, estimate, tracker statistics and the final
    weights equal the single-process reference, on all four ranks; with AdamW the norms
    are preconditioned and AdaScale's gains give the same weights."""
    single, ranks = four_ranks
    optimizer = "adamw" if "adamw" in case else "momentum"
    rows, log, stats, weights = single[optimizer]
    for rank in ranks:
        got_rows, got_log, got_stats, _, names = rank[case]
        assert not any(n.startswith("module.") for n in names)
        assert len(got_log) == len(log) == (STEPS - 1 if optimizer == "adamw" else STEPS)
        for got, want in zip(got_rows, rows, strict=True):
            assert got[2:] == want[2:]  # token counts: micro-batch 0's mean, the step's
            n = 1 if optimizer == "adamw" else 2  # one process reports its plain big norm
            assert got[:n] == pytest.approx(want[:n], rel=1e-9)
        for got, want in zip(got_log, log, strict=True):
            assert got == pytest.approx(want, rel=1e-8)
        for key in ("gns", "gns_sq_norm", "gns_trace", "adascale_gain"):
            if key in stats:
                assert got_stats[key] == pytest.approx(stats[key], rel=1e-8), key
    if optimizer == "adamw":
        assert stats["adascale_gain"] > 1.0
    got_weights = ranks[0][case][3]
    assert got_weights.keys() == weights.keys()
    for name, w in got_weights.items():
        torch.testing.assert_close(w, weights[name], rtol=1e-9, atol=1e-12, msg=name)


# ---------------------------------------------------------------- the main job


def _job_args(out, steps, *extra):
    return ["train", "--task", "charlm", "--nproc", "4", "--out", str(out), "--steps", str(steps),
            "--no-progress", "--no-tensorboard", "--log-every", "1",
            *[a for k, v in TINY.items() for a in ("--task-opt", f"{k}={v}")],
            "--set", "pipeline.pp_degree=2", "--set", "pipeline.accumulate_steps=2",
            "--set", "batch.global_batch_size=32", "--set", "batch.warmup_epochs=0",
            "--set", "adaptive.noise_scale=true", "--set", "adaptive.gns_warmup_steps=0", *extra]


@pytest.mark.slow  # test_pipeline_gns.py has the fast one
def test_main_job_writes_the_noise_scale(tmp_path, capfd):
    import re

    from bigbatch.cli.main import main
    from bigbatch.tasks import get_task

    out = tmp_path / "run"
    assert main(_job_args(out, 4)) == 0
    # The run's header counts the whole model, not the first stage's part of it.
    line = next(x for x in capfd.readouterr().err.splitlines() if x.startswith("weight decay"))
    task = get_task("charlm", **TINY)
    model = task.build_model(task.check_model(None))
    counted = [int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) parameters\)", line)]
    assert sum(counted) == sum(p.numel() for p in model.parameters()), line
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gns = [r["gns"] for r in rows if "gns" in r]
    assert gns and all(g == g for g in gns) and all(r["gns_biased"] == 0.0
                                                    for r in rows if "gns" in r)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["micro_batch_size"]) == (4, 8)


# test_sharded_train's charlm LAMB run, without its merge, with the noise scale on.
JOB = (STRATEGY.replace("[gradient_merge]\nk_steps = 2\n", "")
       + "\n[adaptive]\nnoise_scale = true\ngns_warmup_steps = 0\n")
SINGLE = JOB + "\n[gradient_merge]\nk_steps = 2\n"
PP2_DP2 = JOB + "\n[pipeline]\npp_degree = 2\naccumulate_steps = 2\n"


def _job_config(out, **kw):
    from bigbatch.train.trainer import TrainConfig

    base = dict(task="charlm", task_options=TINY, steps=6, out=str(out), checkpoint_every=2,
                log_every=1, progress=False, tensorboard=False, eval_batch_size=512)
    return TrainConfig(**{**base, **kw})


def _job_worker(full, cut):
    from bigbatch.train.trainer import TrainConfig, train
    from tests.test_train import _train_with_crash

    done = [train(full, Strategy.from_toml(PP2_DP2))["steps"]]
    done.append(_train_with_crash(cut, PP2_DP2, crash_at_call=2))
    done.append(train(TrainConfig(**{**cut.to_dict(), "resume": True}),
                      Strategy.from_toml(PP2_DP2))["steps"])
    return done


def test_main_job_with_ddp_stages_equals_one_process_and_resumes_exactly(tmp_path, train_env):
    """pipeline 2 x data 2 (micro 8 x 2 micro-batches x 2 data ranks) through the trainer:
    final.pt equals one process merging 2 x 16 (float32, 1e-5), a run killed at step 4's
    checkpoint resumes to the same bits, noise-scale statistics included."""
    from bigbatch.train.trainer import train

    dirs = {n: tmp_path / n for n in ("full", "cut", "single")}
    got = run_workers(_job_worker, 4, (_job_config(dirs["full"]), _job_config(dirs["cut"])),
                      timeout=300, init_group=True)
    assert got == [[6, "crashed", 6]] * 4
    train(_job_config(dirs["single"]), Strategy.from_toml(SINGLE))
    final = {n: torch.load(d / "final.pt", weights_only=True) for n, d in dirs.items()}
    assert final["full"].keys() == final["single"].keys()
    for k, w in final["full"].items():
        torch.testing.assert_close(w, final["single"][k], rtol=1e-5, atol=1e-6, msg=k)
        assert torch.equal(w, final["cut"][k]), k
    last = {}
    for name in ("full", "cut"):
        rows = [json.loads(x) for x in (dirs[name] / "metrics.jsonl").read_text().splitlines()]
        last[name] = [(r["gns_sq_norm"], r["gns_trace"]) for r in rows
                      if r["kind"] == "train" and r["step"] == 6]
    assert len(last["full"]) == 1 and last["cut"][-1] == last["full"][0]  # the tracker resumed
    summary = json.loads((dirs["full"] / "summary.json").read_text())
    assert (summary["world_size"], summary["micro_batch_size"], summary["k_steps"]) == (4, 8, 2)
