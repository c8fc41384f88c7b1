"""`bigbatch monitor OUT`: a one-shot text view and the PNG of a finished run; a live file's
half-written last line is skipped."""

import json

import pytest
from test_elastic_resume import STRATEGY  # the small LARS run with the noise scale on

from bigbatch.cli.main import main
from bigbatch.config.strategy import Strategy
from bigbatch.train.monitor import read_run, sparkline
from bigbatch.train.trainer import TrainConfig, train
from tests._cli import TINY


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        mp.delenv(name, raising=False)
    try:
        train(TrainConfig(task="mnist1d", model="mlp", task_options={"num_samples": 1000},
                          steps=12, out=str(out), log_every=1, progress=False,
                          tensorboard=False), Strategy.from_toml(STRATEGY))
    finally:
        mp.undo()
    return out


def test_one_shot_text_view_of_a_finished_run(finished, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["monitor", str(finished), "--once"]) == 0
    text = capsys.readouterr().out
    assert "finished" in text and "step 12" in text
    view = read_run(finished)
    loss = view.series("loss")[1]
    for row in ("loss", "lr", "global batch", "noise scale", "trust-ratio spread", "test accuracy"):
        assert row in text, row
    assert f"{loss[-1]:.4g}" in text and sparkline(loss, log=True) in text
    assert "trend, last 32 logged steps (loss: log scale)" in text
    assert len(view.series("gns")[1]) > 0 and len(view.spread()[1]) == 12


def test_png_is_written_into_the_run_directory(finished, capsys):
    assert main(["monitor", str(finished), "--png"]) == 0
    png = finished / "monitor.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_a_live_file_is_read_up_to_its_last_whole_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n" + '{"kind": "tra')
    view = read_run(tmp_path)
    assert view.series("loss") == ([1.0], [2.0]) and view.status == "running"


def test_monitor_of_a_directory_without_metrics_waits_then_is_one_line_exit_2(tmp_path, capsys):
    assert main(["monitor", str(tmp_path), "--wait", "0.3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"bigbatch monitor: waiting up to 0.3 s for a run to start writing "
                      f"{tmp_path / 'metrics.jsonl'}")
    assert len(err) == 2 and "no metrics.jsonl after 0.3 s" in err[1] and "--wait" in err[1]


def test_monitor_started_before_the_run_waits_for_it(tmp_path, capsys, monkeypatch):
    """`bigbatch train --out OUT & bigbatch monitor OUT`: OUT and its metrics come later."""
    import threading

    monkeypatch.setenv("COLUMNS", "160")
    out = tmp_path / "starting"

    def start():
        out.mkdir()
        (out / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1,
                                                       "loss": 2.0}) + "\n")

    timer = threading.Timer(0.4, start)
    timer.start()
    try:
        assert main(["monitor", str(out), "--once", "--wait", "20"]) == 0
    finally:
        timer.join()
    captured = capsys.readouterr()
    assert "waiting up to 20 s" in captured.err and "running" in captured.out


def test_loss_panel_is_on_a_log_scale(finished, monkeypatch):
    import matplotlib.pyplot as plt

    from bigbatch.train.monitor_figure import write_figure

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    write_figure(read_run(finished), finished / "log.png")
    loss, lr = figures[0].axes[:2]
    assert loss.get_title() == "train loss" and loss.get_yscale() == "log"
    assert lr.get_yscale() == "linear"


def _lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def test_damaged_and_foreign_lines_are_skipped_and_counted_and_names_shown_as_text(
        tmp_path, capsys, monkeypatch):
    """A run's own files never crash the monitor: a line without a step, per-rank lists of
    different lengths, a straggler without its ratio, text that is not JSON and JSON that is
    not a record are skipped and counted; names that look like rich markup show literally."""
    monkeypatch.setenv("COLUMNS", "200")
    ranks = {"kind": "ranks", "step": 2, "compute_s": [0.01, 0.02], "data_s": [0.0, 0.0],
             "sync_s": [0.001, 0.001], "micro_batch_sizes": ["[/bold]", 32]}
    (tmp_path / "metrics.jsonl").write_text(_lines(
        {"kind": "train", "step": 1, "loss": 2.0},
        {"kind": "train", "loss": 1.5},                                   # no step
        {"kind": "train", "step": "two", "loss": 1.4},                    # a step that is text
        "not json at all",
        [1, 2, 3],
        {"kind": "ranks", "step": 2, "compute_s": [0.01, 0.02], "data_s": [0.0],
         "sync_s": [0.0, 0.0]},                                           # a short list
        {"kind": "straggler", "step": 2, "rank": 1},                      # no ratio
        ranks,
        {"kind": "my_policy", "note": "a policy's own record"},           # not counted
        {"kind": "train", "step": 2, "loss": 1.0, "epoch": "[red]"},
        {"kind": "eval", "step": 2, "[/bold]x": 0.5, "[red]acc[/red]": 0.25},
        {"kind": "batch_size", "step": 2, "old": "[/b]", "new": 128, "reason": "[/i]"},
    ))
    (tmp_path / "summary.json").write_text("[]")  # not an object: as if absent
    (tmp_path / "stopped.json").write_text(json.dumps(
        {"message": "[/bold] a stop", "status": 3, "step": 2}))
    view = read_run(tmp_path)
    assert view.skipped == 6 and [r["step"] for r in view.train] == [1, 2]
    assert view.ranks == [ranks] and view.summary is None
    assert main(["monitor", str(tmp_path), "--once"]) == 0
    text = capsys.readouterr().out
    assert "skipped 6 lines of metrics.jsonl" in text
    for literal in ("test [/bold]x (step 2)", "test [red]acc[/red] (step 2)", "[/bold]",
                    "global batch [/b] -> 128 ([/i])", "stopped (status 3): [/bold] a stop"):
        assert literal in text, literal
    assert main(["monitor", str(tmp_path), "--png"]) == 0
    assert (tmp_path / "monitor.png").stat().st_size > 0


def test_a_run_stopped_by_a_non_finite_loss_says_why(tmp_path, capsys, monkeypatch,
                                                       train_env):
    """The trainer records why it stopped (OUT/stopped.json, one of the run's files), so a
    later `monitor` says so instead of "interrupted?"."""
    import importlib
    import math

    plan = importlib.import_module("bigbatch.train.plan")  # where the trainer gets its task
    real, calls = plan.get_task, []

    def get_task(*args, **kw):
        task = real(*args, **kw)
        loss = task.loss

        def nan_at_step_3(out, batch):
            calls.append(1)
            total, count = loss(out, batch)
            return (total * math.nan if len(calls) == 3 else total), count

        task.loss = nan_at_step_3
        return task

    monkeypatch.setattr(plan, "get_task", get_task)
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--out", str(out), *TINY, "--steps", "6",
                 "--log-every", "1"]) == 1
    capsys.readouterr()
    assert "stopped.json" in json.loads((out / ".bigbatch-files.json").read_text())["files"]
    assert main(["monitor", str(out), "--once"]) == 0
    text = capsys.readouterr().out
    assert "stopped (status 1): non-finite loss at optimizer step 3" in text, text
    assert "interrupted" not in text
