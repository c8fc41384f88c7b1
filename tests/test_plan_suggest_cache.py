"""`--suggest` shares work between its candidates (the micro-batch probes, the layers'
inputs, the built meta model, FLOP counting without module hooks): each candidate it
lists must equal the same layout planned on its own, from nothing."""

from __future__ import annotations

import pytest

from bigbatch.config.strategy import Strategy
from bigbatch.planner.devices import DEVICES
from bigbatch.planner.planning import plan_task
from bigbatch.planner.suggest import suggest
from bigbatch.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_thread")


def _same(a, b) -> None:
    da, db = a.to_dict(), b.to_dict()
    da.pop("seconds", None)
    db.pop("seconds", None)
    assert da == db
    assert a.time(DEVICES["h100"]).to_dict() == b.time(DEVICES["h100"]).to_dict()


def test_suggest_with_shared_work_equals_each_layout_planned_alone():
    task = get_task("charlm", d_model=64, n_layer=4, n_head=4, seq_len=32)
    strategy = Strategy.from_toml(task.demo_strategy).with_overrides(
        ["batch.global_batch_size=none", "batch.micro_batch_size=1"])
    world = 8

    def plan_one(s, **kw):
        return plan_task(task, s, world, gpu_memory=None, **kw)

    rows, tried = suggest(strategy, world, lambda s, probes: plan_one(
        s, probes=probes, ends_only=True), None,
        seconds=lambda p: p.time(DEVICES["h100"]).seconds)
    assert tried >= 10 and len(rows) >= 10  # a few the engine refuses
    shapes = {(p.degrees.tensor, p.degrees.pipeline) for p, _ in rows}
    assert {(1, 1), (2, 1), (1, 2), (2, 2)} <= shapes
    for shared, _ in rows:
        alone = plan_one(shared.strategy, ends_only=True)
        _same(shared, alone)
