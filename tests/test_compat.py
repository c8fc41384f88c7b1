"""Files written by bigbatch 0.1.0 (before the package was split into subpackages)
still load: a run directory with its `strategy.toml`, `run.json` and a step-2
checkpoint resumes to the weights that the uninterrupted 0.1.0 run ended with.

The fixture in tests/data/run_v0_1 was made with the 0.1.0 layout by
`bigbatch train --steps 4 --checkpoint-every 2 --nproc 1 --task-opt num_samples=2000
--set batch.global_batch_size=256 --set batch.warmup_epochs=0 --set batch.warmup_steps=1
--set adaptive.noise_scale=true --no-progress`; `expected_final.pt` is that run's final.pt.
"""

import shutil
from pathlib import Path

import torch

from bigbatch.cli.main import main
from bigbatch.config.strategy import Strategy

DATA = Path(__file__).parent / "data" / "run_v0_1"


def test_strategy_toml_of_0_1_loads():
    s = Strategy.from_toml(DATA / "strategy.toml")
    assert s.batch.global_batch_size == 256
    assert s.lars.enable and s.lars.lars_coeff == 0.01
    assert s.adaptive.noise_scale


def test_checkpoint_of_0_1_resumes_to_the_same_weights(train_env, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(DATA, out)
    (out / "expected_final.pt").unlink()
    code = main(["train", "--resume", "--out", str(out), "--steps", "4", "--checkpoint-every", "2",
                 "--nproc", "1", "--task-opt", "num_samples=2000", "--no-progress",
                 "--no-tensorboard", "--config", str(DATA / "strategy.toml")])
    assert code == 0
    got = torch.load(out / "final.pt", weights_only=True)
    want = torch.load(DATA / "expected_final.pt", weights_only=True)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
