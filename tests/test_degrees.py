"""`Degrees` names each fact about a layout once (torchtitan's ParallelDims): which
parallel forms are on, whether the ranks need a device mesh, whether FSDP2 wraps the
model, and whether the state is saved per rank (DCP)."""

import pytest

from bigbatch.config.parallelism import degrees
from bigbatch.config.strategy import Strategy

FACTS = ("dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "tp_enabled", "pp_enabled",
         "zero1_enabled", "params_sharded", "needs_mesh", "fsdp_enabled", "sharded_state")


@pytest.mark.parametrize(("body", "world", "true"), [
    ({}, 1, set()),
    ({}, 4, {"dp_enabled", "dp_replicate_enabled"}),
    ({"sharding": {"stage": 1}}, 4, {"dp_enabled", "dp_shard_enabled", "zero1_enabled"}),
    ({"sharding": {"stage": 2}}, 4, {"dp_enabled", "dp_shard_enabled", "params_sharded",
                                     "needs_mesh", "fsdp_enabled", "sharded_state"}),
    ({"sharding": {"stage": 3, "sharding_degree": 2}}, 8,
     {"dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "params_sharded",
      "needs_mesh", "fsdp_enabled", "sharded_state"}),
    ({"sharding": {"stage": 3}}, 1, {"params_sharded", "needs_mesh", "sharded_state"}),
    ({"tensor_parallel": {"tensor_parallel_degree": 2}}, 2,
     {"tp_enabled", "needs_mesh", "sharded_state"}),
    ({"tensor_parallel": {"tensor_parallel_degree": 2}}, 4,
     {"dp_enabled", "dp_replicate_enabled", "tp_enabled", "needs_mesh", "fsdp_enabled",
      "sharded_state"}),
    ({"pipeline": {"pp_degree": 2}}, 2, {"pp_enabled", "needs_mesh", "sharded_state"}),
    ({"pipeline": {"pp_degree": 1}}, 2, {"dp_enabled", "dp_replicate_enabled"}),
    ({"parameter_server": {"servers": 1}}, 3, {"dp_enabled", "dp_replicate_enabled"}),
])
def test_each_fact_of_a_layout(body, world, true):
    deg = degrees(Strategy.from_dict(body), world)
    assert {name for name in FACTS if getattr(deg, name)} == true
