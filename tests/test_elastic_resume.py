"""Resume on another world size: same global batch, data position kept in samples."""

import json

import pytest

from bigbatch.config.strategy import Strategy
from bigbatch.tasks import get_task
from bigbatch.train.trainer import TrainConfig, train
from tests._dist import run_workers

SMALL = {"num_samples": 1000}  # 800 train samples: 12 steps of 64 per epoch
STRATEGY = """
[batch]
global_batch_size = 64
base_batch_size = 32
base_lr = 0.05
warmup_steps = 2

[lars]
lars_coeff = 0.01

[adaptive]
noise_scale = true
"""


pytestmark = pytest.mark.usefixtures("train_env")


def _config(out, **kw):
    base = dict(task="mnist1d", model="mlp", task_options=SMALL, steps=10, out=str(out),
                checkpoint_every=5, log_every=1, progress=False, tensorboard=False)
    return TrainConfig(**{**base, **kw})


def _train(config, text):
    return train(config, Strategy.from_toml(text))["steps"]


@pytest.mark.slow  # ~30 s on 2 shared cores
def test_two_workers_checkpoint_one_worker_resumes_at_the_same_global_batch(tmp_path):
    get_task("mnist1d", **SMALL)
    out = tmp_path / "run"
    assert run_workers(_train, 2, (_config(out), STRATEGY), timeout=120,
                       init_group=True) == [10, 10]
    first = json.loads((out / "summary.json").read_text())
    assert (first["world_size"], first["micro_batch_size"]) == (2, 32)
    s = train(_config(out, steps=16, resume=True), Strategy.from_toml(STRATEGY))
    assert (s["world_size"], s["global_batch_size"]) == (1, 64)
    assert s["micro_batch_size"] * s["k_steps"] == 64  # the lost worker's share: merge steps
    assert s["steps"] == 16 and s["samples"] == 16 * 64  # position kept in samples
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if x["kind"] == "train"]
    assert steps == list(range(1, 17))  # no step repeated or skipped across the resume
    assert all(x["global_batch_size"] == 64 for x in lines if x["kind"] == "train")
    noise = [x for x in lines if x["kind"] == "train" and x["step"] > 10]
    assert any(k.startswith("gns") or "noise" in k for k in noise[-1]), noise[-1].keys()


PER_WORKER = """
[batch]
micro_batch_size = 32
base_batch_size = 32
base_lr = 0.05
scaling = "linear"
warmup_steps = 0
decay = "none"
elastic = "scale"

[lars]
lars_coeff = 0.01
"""


def test_scale_moves_the_global_batch_with_the_workers_and_keeps_the_length_in_samples(
        tmp_path):
    get_task("mnist1d", **SMALL)
    out = tmp_path / "run"
    first = train(_config(out, steps=8), Strategy.from_toml(PER_WORKER))
    assert (first["global_batch_size"], first["peak_lr"]) == (32, 0.05)
    # 16 steps of the first run's 32 samples: 8 done, the other 256 samples in steps of 64.
    got = run_workers(train, 2, (_config(out, steps=16, resume=True),
                                 Strategy.from_toml(PER_WORKER)), timeout=120, init_group=True)
    s = got[0]
    assert (s["world_size"], s["global_batch_size"], s["micro_batch_size"]) == (2, 64, 32)
    assert s["peak_lr"] == 0.1  # linear: twice the batch, twice the LR
    assert s["steps"] == 8 + 4 and s["samples"] == 16 * 32
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {x["step"]: (x["lr"], x["global_batch_size"]) for x in lines if x["kind"] == "train"}
    assert lrs[8] == (0.05, 32) and lrs[9] == (0.1, 64) and max(lrs) == 12
