"""The sync_switch policy (issue 40, KungFu): all-reduce <-> local SGD at a step boundary
while the job runs. A test-only delay inside the reduction (BIGBATCH_TEST_SLOW_REDUCE)
makes communication dominate steps 3..8 on 2 gloo workers: the policy goes local at
step 4 and back at step 10; both switches are logged; a crash at step 10's checkpoint
resumed from step 5 (in local mode) ends with the uninterrupted run's weights."""

from __future__ import annotations

import json

import pytest

from bigbatch.config.strategy import Strategy
from bigbatch.engine.sync_switch import comm_fraction
from bigbatch.errors import ConfigError
from bigbatch.parallel.switchable_reduce import SLOW_REDUCE_ENV
from tests._dist import run_workers

pytestmark = pytest.mark.usefixtures("train_env")

SWITCHING = """
[batch]
global_batch_size = 64
base_batch_size = 32
base_lr = 0.05
warmup_steps = 2

[optimizer]
type = "momentum"

[adaptive]
policies = ["sync_switch"]

[sync_switch]
threshold = 0.8
window_steps = 2
k_steps = 2
"""


def test_comm_fraction():
    assert comm_fraction(3.0, 1.0) == 0.75
    assert comm_fraction(0.0, 0.0) == 0.0


@pytest.mark.parametrize("key,value,says", [
    ("threshold", 1.0, "sync_switch.threshold"),
    ("threshold", 0.0, "sync_switch.threshold"),
    ("window_steps", 0, "sync_switch.window_steps"),
    ("k_steps", 0, "sync_switch.k_steps"),
])
def test_bad_keys_are_one_line(key, value, says):
    with pytest.raises(ConfigError, match=says) as e:
        Strategy.from_dict({"adaptive": {"policies": ["sync_switch"]},
                            "sync_switch": {key: value}})
    assert "\n" not in str(e.value)


def test_overview_shows_the_section_only_when_on():
    on = Strategy.from_toml(SWITCHING).overview(2)
    assert "[sync_switch]" in on and "window_steps" in on
    assert "[sync_switch]" not in Strategy.from_dict({}).overview(2)


@pytest.mark.slow  # ~15 s on 2 shared cores: 2 gloo workers train 3 runs of 12 steps
def test_switches_under_a_slow_allreduce_and_resumes_exactly(tmp_path, monkeypatch):
    import test_train as tt

    from bigbatch.tasks import get_task
    from bigbatch.train.monitor import read_run, render

    get_task("mnist1d", **tt.SMALL)
    monkeypatch.setenv(SLOW_REDUCE_ENV, "0.4@3-8")
    full, cut = tmp_path / "full", tmp_path / "cut"
    # 12 steps: few windows outside the delay, where a loaded box could read its own
    # slowness as communication (the switch is a measurement, not a schedule)
    got = run_workers(tt._full_crash_resume, 2, (tt._config(full, steps=12),
                                                 tt._config(cut, steps=12), SWITCHING, 2),
                      timeout=300, init_group=True)
    assert got == [[12, "crashed", 12]] * 2  # killed at step 10's checkpoint, resumed from 5
    tt._assert_same_weights(tt._final(full), tt._final(cut))

    lines = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    switches = [(x["step"], x["old"], x["new"]) for x in lines if x["kind"] == "sync_switch"]
    assert switches == [(4, "allreduce", "local"), (10, "local", "allreduce")]
    shares = [x["comm_fraction"] for x in lines if x["kind"] == "sync_switch"]
    assert shares[0] > 0.8 >= shares[1]
    mode = {x["step"]: x["sync_local"] for x in tt._train_lines(full)}
    assert mode[2] == 0 and mode[6] == mode[8] == 1 and mode[12] == 0
    resumed = [x for x in (json.loads(y) for y in (cut / "metrics.jsonl").read_text()
                           .splitlines()) if x["kind"] == "sync_switch"]
    assert (10, "local", "allreduce") in [(x["step"], x["old"], x["new"]) for x in resumed]

    view = read_run(full)
    assert len(view.sync_switches) == 2
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render(view))
    assert "synchronisation allreduce -> local" in console.export_text()
