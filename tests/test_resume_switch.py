"""A resume may switch the synchronisation and the measuring [adaptive] keys (issue 40);
what it still refuses, and why, is in `bigbatch.train.resume`."""

import pytest

from bigbatch.config.strategy import Strategy
from bigbatch.train.resume import differences

BASE = {"batch": {"global_batch_size": 64, "base_batch_size": 32},
        "optimizer": {"type": "momentum"}}


def _diff(before: dict, after: dict) -> list[str]:
    old, new = Strategy.from_dict({**BASE, **before}), Strategy.from_dict({**BASE, **after})

    class Config:
        def to_dict(self):
            return {}

    ckpt = {"config": {}, "strategy": old.to_dict()}
    return [k for k, _, _ in differences(Config(), new, ckpt, "mlp")]


@pytest.mark.parametrize("before,after", [
    ({}, {"data_parallel": {"reduce": "adasum"}}),
    ({"data_parallel": {"reduce": "fp16"}}, {"data_parallel": {"reduce": "mean"}}),
    ({}, {"localsgd": {"k_steps": 4}}),
    ({"localsgd": {}}, {"localsgd": {"averaging": "pairwise"}}),  # the checkpoint is the mean
    ({"adaptive_localsgd": {"init_k_steps": 2}}, {}),
    ({}, {"adaptive": {"noise_scale": True}}),
    ({}, {"adaptive": {"policies": ["straggler"]}}),
    # PowerSGD keeps only its step count and random state: in or out through a checkpoint
    ({}, {"data_parallel": {"reduce": "powersgd", "start_powersgd_iter": 2}}),
    ({"data_parallel": {"reduce": "powersgd"}}, {"data_parallel": {"reduce": "mean"}}),
    ({"data_parallel": {"reduce": "powersgd"}}, {"data_parallel": {"reduce": "adasum"}}),
    ({"data_parallel": {"reduce": "powersgd"}},
     {"data_parallel": {"reduce": "powersgd", "powersgd_rank": 4}}),
])
def test_switches_a_resume_accepts(before, after):
    assert _diff(before, after) == []


@pytest.mark.parametrize("before,after,key", [
    # DGC owns momentum and weight decay in its hook: the optimizer state cannot follow
    ({}, {"data_parallel": {"reduce": "dgc"}}, "data_parallel.reduce"),
    ({"data_parallel": {"reduce": "dgc"}}, {"data_parallel": {"reduce": "powersgd"}},
     "data_parallel.reduce"),
    ({}, {"adaptive": {"gns_gradient": "raw", "noise_scale": True}}, "adaptive.gns_gradient"),
    ({}, {"batch": {**BASE["batch"], "base_lr": 0.2}}, "batch.base_lr"),
])
def test_what_a_resume_still_refuses(before, after, key):
    assert key in _diff(before, after)
