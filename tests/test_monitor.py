"""`bigbatch monitor OUT`: a one-shot text view and the PNG of a finished run; a live file's
half-written last line is skipped."""

import json

import pytest
from test_elastic_resume import STRATEGY  # the small LARS run with the noise scale on

from bigbatch.cli.main import main
from bigbatch.config.strategy import Strategy
from bigbatch.train.monitor import read_run, sparkline
from bigbatch.train.trainer import TrainConfig, train


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
