"""`bigbatch plan --burst` (DeepPool's burst parallelism, `bigbatch.planner.burst`): the
width chooser on hand-made layer times, and the command on a small model."""

from __future__ import annotations

import json

import pytest

from bigbatch.cli.main import main
from bigbatch.planner.burst import BurstPlan, LayerTimes, choose_widths
from bigbatch.planner.devices import DEVICES

pytestmark = pytest.mark.usefixtures("one_thread")

H100 = DEVICES["h100"]
WIDTHS = [1, 2, 4, 8]


def _layer(name: str, work: float, fixed: float, reduce: float) -> LayerTimes:
    """`work` seconds that split over the ranks, `fixed` that do not, an all-reduce of
    `reduce` seconds on any width above one."""
    return LayerTimes(name, {w: work / w + fixed for w in WIDTHS},
                      {w: reduce if w > 1 else 0.0 for w in WIDTHS}, out_bytes_per_sample=0.0)


def test_widths_follow_each_layers_scaling_within_the_limit():
    conv = _layer("conv", work=8.0, fixed=0.0, reduce=0.01)     # scales almost perfectly
    fc = _layer("fc", work=0.2, fixed=0.1, reduce=0.2)          # mostly its all-reduce
    widths, edges = choose_widths([conv, fc], WIDTHS, 2.0, batch=64, dev=H100)
    # within a budget of 2: conv fastest at 8 (GPU-time 8 x 1.01), fc fastest at 1 (0.3 s;
    # its all-reduce makes it slower on more ranks).
    assert widths == [8, 1]
    # 8 -> 1: a gather forward and a scatter backward, 7 hops each (no bytes here).
    assert edges == [pytest.approx(2 * 7 * H100.intra.latency)]
    p = BurstPlan(world=8, batch=64, limit=2.0, device="h100", layers=[conv, fc],
                  widths=widths, boundary_seconds=edges)
    assert p.step_seconds == pytest.approx(1.01 + 0.3 + edges[0])
    assert p.uniform_seconds == pytest.approx(1.01 + 0.325)  # fc: 0.2/8 + 0.1 + 0.2
    assert p.gpu_seconds == pytest.approx(8 * 1.01 + 0.3 + 8 * edges[0])
    assert p.freed_gpu_seconds == pytest.approx(8 * p.step_seconds - p.gpu_seconds)
    assert p.amplification == pytest.approx(p.gpu_seconds / (8.0 + 0.3))
    # a limit of 1 keeps every layer at its most economical width; a tighter budget than
    # [8, 1]'s (8.38 / 8.3 = 1.0096) takes conv to 4 (4 x 2.01 + 0.3 + edges: 1.0048).
    assert choose_widths([conv, fc], WIDTHS, 1.0, 64, H100)[0] == [1, 1]
    assert choose_widths([conv, fc], WIDTHS, 1.005, 64, H100)[0] == [4, 1]


def test_a_boundary_that_costs_more_than_it_saves_is_not_taken():
    a = _layer("a", work=1.0, fixed=0.0, reduce=0.0)
    b = _layer("b", work=0.0, fixed=0.01, reduce=0.0)  # the same on any width
    b.out_bytes_per_sample = a.out_bytes_per_sample = 1e9  # a huge activation
    widths, _ = choose_widths([a, b], WIDTHS, 100.0, batch=64, dev=H100)
    assert widths == [8, 8]


CHARLM = ["plan", "--task", "charlm", "--task-opt", "d_model=64", "--task-opt", "n_layer=2",
          "--task-opt", "n_head=4", "--task-opt", "seq_len=32", "--world", "8",
          "--set", "batch.global_batch_size=64", "--burst"]


def test_cli_burst_reports_step_against_uniform_and_freed_gpu_seconds(capsys):
    assert main([*CHARLM, "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["burst"]
    assert b["world"] == 8 and b["global_batch"] == 64 and b["amplification_limit"] == 2.0
    assert [layer["name"] for layer in b["layers"]] == ["embed", "blocks.0", "blocks.1",
                                                         "norm_f", "head"]
    assert all(layer["width"] in (1, 2, 4, 8) for layer in b["layers"])
    assert 1.0 <= b["amplification"] <= 2.0 + 1e-9
    assert b["freed_gpu_seconds_per_step"] == pytest.approx(
        8 * b["step_seconds"] - b["gpu_seconds_per_step"])
    assert b["freed_gpu_seconds_per_step"] >= 0 and b["uniform_step_seconds"] > 0
    assert main(CHARLM) == 0
    text = capsys.readouterr().out
    assert "burst plan (DeepPool) on 8 x" in text and "freed for a background job" in text


@pytest.mark.parametrize(("args", "message"), [
    (["--amplification", "0.5"], "--amplification 0.5: expected a number >= 1"),
    (["--world", "6", "--set", "batch.global_batch_size=12"],
     "--burst: --world 6 is not a power of two"),
])
def test_cli_burst_bad_input_is_one_line(capsys, args, message):
    assert main([*CHARLM, *args]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if "Warning" not in line]
    assert out == "" and len(lines) == 1 and message in lines[0], err
