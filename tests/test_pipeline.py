"""Pipeline parallelism through the engine: GPipe, 1F1B and interleaved 1F1B on 2 gloo
ranks, and pipeline 2 x data 2 on 4, with LAMB, equal the unsplit single-process
charlm Transformer on the same global batch after 10 steps (float32, 1e-5), with
exact token counts and the embedding tied to the LM head across the two ends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError
from bigbatch.parallel.pipeline import model_layers, split_layers
from bigbatch.parallel.world import World
from bigbatch.tasks.charlm import CharLM

TINY = dict(seq_len=16, d_model=32, n_layer=2, n_head=4)
STEPS, K, GLOBAL = 10, 4, 16


def make_strategy(pipeline: dict | None, extra: dict | None = None) -> Strategy:
    d: dict = {
        "batch": {"global_batch_size": GLOBAL, "base_batch_size": 16, "base_lr": 0.01,
                  "warmup_steps": 2},
        "optimizer": {"type": "adamw", "weight_decay": 0.0, "epsilon": 1e-6},
        "lamb": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ["norm", "bias"]},
    }
    if pipeline is None:
        d["gradient_merge"] = {"k_steps": K}
    else:
        d["pipeline"] = {"accumulate_steps": K, **pipeline}
    return Strategy.from_dict({**d, **(extra or {})})


def tokens():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 100, (STEPS, GLOBAL, TINY["seq_len"]), generator=g)
    y = torch.randint(0, 100, (STEPS, GLOBAL, TINY["seq_len"]), generator=g)
    y[torch.rand(y.shape, generator=g) < 0.2] = -100
    return x, y


def token_loss(logits, y):
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    return loss, (y != -100).sum()


def single_run(task, extra=None, with_run=False, norms=False):
    torch.manual_seed(0)
    run = prepare(task.build_model(), make_strategy(None, extra), total_steps=STEPS,
                  world=World(), track_stats=norms)
    if norms:
        run.norms_seen = []
        run.step_hooks.append(lambda r: r.norms_seen.append(float(r.stats["grad_norm"])))
    x, y = tokens()
    micro = GLOBAL // K
    for step in range(STEPS):
        for j in range(K):
            rows = slice(j * micro, (j + 1) * micro)
            with run.micro_step() as ms:
                ms.backward(*token_loss(run.model(x[step, rows]), y[step, rows]))
    return (run.module.state_dict(), run) if with_run else run.module.state_dict()


def _worker(cases):
    from bigbatch.train.sharded import whole_model_state

    task = CharLM(**TINY)
    out = {}
    for name, pipe in cases:
        torch.manual_seed(0)
        pipe = dict(pipe)
        extra = {"amp": {"dtype": pipe.pop("amp")}} if "amp" in pipe else None
        if "clip" in pipe:
            extra = clipped(pipe.pop("clip"))
        run = prepare(task.build_model(), make_strategy(pipe, extra), total_steps=STEPS,
                      track_stats=True)
        norms: list[float] = []
        run.step_hooks.append(lambda r, seen=norms: seen.append(float(r.stats["grad_norm"])))
        data, d = run.mesh.data_degree, run.mesh.data_rank
        x, y = tokens()
        rows = slice(d * GLOBAL // data, (d + 1) * GLOBAL // data)
        losses = []
        for step in range(STEPS):
            total, count = run.pipeline_step(x[step, rows], y[step, rows], token_loss)
            losses.append((float(total), float(count)))
        assert run.step + run.skipped_steps == STEPS
        out[name] = (whole_model_state(run.module, run.mesh, run.pipeline), losses,
                     run.pipeline.layer_names, run.step, run.skipped_steps, norms)
    return out


CASES_2 = [("gpipe", {"pp_degree": 2, "schedule_mode": "GPipe"}),
           ("1f1b", {"pp_degree": 2, "schedule_mode": "1F1B"}),
           ("interleaved", {"pp_degree": 2, "schedule_mode": "Interleaved1F1B",
                            "virtual_stages": 2}),
           ("1f1b-fp16", {"pp_degree": 2, "amp": "float16"}),
           ("1f1b-clip", {"pp_degree": 2, "clip": 0.05})]


def clipped(max_norm: float) -> dict:
    return {"optimizer": {"type": "adamw", "weight_decay": 0.0, "epsilon": 1e-6,
                          "max_grad_norm": max_norm}}


@pytest.fixture(scope="module")
def single():
    return single_run(CharLM(**TINY))


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(_worker, 2, (CASES_2,), timeout=240, init_group=True)


@pytest.fixture(scope="module")
def four_ranks():
    return run_workers(_worker, 4, ([("pp2xdp2", {"pp_degree": 2}),
                                     ("pp2xdp2-clip", {"pp_degree": 2, "clip": 0.05})],),
                       timeout=300, init_group=True)


def _assert_equal_to(single, weights):
    assert weights.keys() == single.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, single[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", [c for c, _ in CASES_2 if "fp16" not in c and "clip" not in c])
def test_pipeline_2_equals_single_process(single, two_ranks, case):
    weights, losses, layers, _, _, _ = two_ranks[0][case]
    _assert_equal_to(single, weights)
    assert all(total == 0 for total, _ in losses)  # the first stage reports nothing
    last = two_ranks[1][case][1]
    assert all(count > 0 for _, count in last)
    if case == "interleaved":
        assert layers == [["embed"], ["blocks.1"]] and two_ranks[1][case][2] == [
            ["blocks.0"], ["norm_f", "head"]]


def test_fp16_pipeline_skips_and_trains_like_one_process(two_ranks):
    """fp16 through the stages: the first stage unscales the gradients it receives with the
    same scale, and every stage skips the same overflow steps as one process."""
    want, run = single_run(CharLM(**TINY), {"amp": {"dtype": "float16"}}, with_run=True)
    for rank in range(2):
        weights, _, _, steps, skipped, _ = two_ranks[rank]["1f1b-fp16"]
        assert (steps, skipped) == (run.step, run.skipped_steps) and skipped > 0
    for name, w in two_ranks[0]["1f1b-fp16"][0].items():
        torch.testing.assert_close(w, want[name], rtol=1e-3, atol=2e-4, msg=name)


def test_pipeline_clips_the_whole_models_norm_like_one_process(two_ranks):
    """Each stage's part of |g|^2 summed over the pipeline, the tied embedding once: the
    same norm, the same clipping and the same weights as one process."""
    want, run = single_run(CharLM(**TINY), clipped(0.05), with_run=True, norms=True)
    assert max(run.norms_seen) > 0.05  # the clip was active
    for rank in range(2):
        norms = two_ranks[rank]["1f1b-clip"][5]
        assert norms == pytest.approx(run.norms_seen, rel=1e-4)
    _assert_equal_to(want, two_ranks[0]["1f1b-clip"][0])


def test_pipeline_x_data_clips_like_one_process(four_ranks):
    """With FSDP2 stages the gradients are sharded over the data ranks: taken whole."""
    want, run = single_run(CharLM(**TINY), clipped(0.05), with_run=True, norms=True)
    for rank in range(4):
        assert four_ranks[rank]["pp2xdp2-clip"][5] == pytest.approx(run.norms_seen, rel=1e-4)
    _assert_equal_to(want, four_ranks[0]["pp2xdp2-clip"][0])


def test_pipeline_2_x_data_2_equals_single_process(single, four_ranks):
    _assert_equal_to(single, four_ranks[0]["pp2xdp2"][0])


def _pipedream_worker():
    task = CharLM(**TINY)
    torch.manual_seed(0)
    run = prepare(task.build_model(), make_strategy(
        {"pp_degree": 2, "schedule_mode": "PipeDream"}), total_steps=STEPS)
    x, y = tokens()
    losses = [run.pipeline_step(x[s], y[s], token_loss) for s in range(STEPS)]
    run.pipeline.settle()
    records = list(run.pipeline._schedule.records)
    return [float(t) / max(float(c), 1) for t, c in losses], records, run.step


def test_pipedream_through_the_engine_stashes_weights_and_learns():
    """Not the big batch (an update per micro-batch, stale by design), but each backward
    uses its forward's weights, and the per-token loss falls."""
    got = run_workers(_pipedream_worker, 2, (), timeout=240, init_group=True)
    for _losses, records, steps in got:
        assert steps == STEPS
        assert records and all(r.backward_version == r.forward_version for r in records)
    stage0, last = got[0][1], got[1][0]
    assert max(r.live_version - r.forward_version for r in stage0) == 1  # stale on stage 0
    assert sum(last[-3:]) < sum(last[:3])


def test_balanced_split_and_split_points():
    model = CharLM(**TINY).build_model()
    layers = model_layers(model)
    assert [layer.name for layer in layers] == ["embed", "blocks.0", "blocks.1", "norm_f", "head"]
    assert split_layers(model, layers, 2, ["blocks.1"]) == [range(0, 2), range(2, 5)]
    assert len(split_layers(model, layers, 4)) == 4
    with pytest.raises(ConfigError, match="no layer named 'block.1'"):
        split_layers(model, layers, 2, ["block.1"])
    with pytest.raises(ConfigError, match="not a chain of layers"):
        model_layers(nn.LSTM(4, 4))


@pytest.mark.parametrize("body, match", [
    ({"pipeline": {"pp_degree": 2, "virtual_stages": 2}}, "needs schedule_mode"),
    ({"pipeline": {"pp_degree": 2}, "gradient_merge": {"k_steps": 2}}, "accumulate_steps"),
    ({"pipeline": {"pp_degree": 2, "split_points": ["a", "b"]}}, "2 stages need 1"),
])
def test_bad_pipeline_settings_name_the_keys(body, match):
    with pytest.raises(ConfigError, match=match):
        Strategy.from_dict(body)


@pytest.mark.parametrize("argv, message", [
    (["--set", "pipeline.accumulate_steps=1"], "fewer than the 2 stages"),
    (["--task", "charlm", "--set", 'pipeline.split_points=["blocks.7"]'],
     "no layer named 'blocks.7'"),
    (["--set", "pipeline.virtual_stages=2"], 'needs schedule_mode = "Interleaved1F1B"'),
    (["--set", "pipeline.pp_degree=3"], "does not divide the world size 2"),
])
def test_cli_refuses_bad_pipelines_before_launch(argv, message, tmp_path, capsys):
    from bigbatch.cli.main import main

    out = tmp_path / "out"
    code = main(["train", "--out", str(out), "--nproc", "2", "--steps", "2", "--no-progress",
                 "--set", "batch.warmup_epochs=0", "--set", "pipeline.pp_degree=2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()
