"""What `bigbatch monitor OUT` shows: a run's `metrics.jsonl` read into series, and a rich
view of them (loss, LR, batch size, noise scale, trust-ratio spread, per-rank step times
with stragglers marked). The figure is `bigbatch.train.monitor_figure`.

The files are read as untrusted: a line that is not JSON, not an object, or a record of a
kind the view shows without the fields it needs (a step, per-rank lists of one length) is
skipped and counted; names from the file are shown as text, never as rich markup.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bigbatch.train.progress import METRICS_FILE
from bigbatch.train.stopped import STOPPED_FILE

__all__ = ["RunView", "read_run", "render"]

SPARK = "▁▂▃▄▅▆▇█"
RECENT_S = 120.0
"""A run whose metrics changed within this many seconds, and that has no summary, is running."""


@dataclass
class RunView:
    """The lines of one run's `metrics.jsonl`, by kind, and how the run stands."""

    out: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    batch_changes: list[dict[str, Any]] = field(default_factory=list)
    autoscale: list[dict[str, Any]] = field(default_factory=list)
    """The worker-count decisions of `--nproc MIN:MAX` (`bigbatch.cli.autoscale`)."""
    sync_switches: list[dict[str, Any]] = field(default_factory=list)
    """All-reduce <-> local SGD switches of the ``sync_switch`` policy."""
    relaunches: list[dict[str, Any]] = field(default_factory=list)
    """Resumes a policy asked for with other strategy keys (`bigbatch.cli.relaunch`)."""
    summary: dict[str, Any] | None = None
    stopped: dict[str, Any] | None = None
    updated: float | None = None
    """When metrics.jsonl last changed (`time.time()`), None without one."""
    skipped: int = 0
    """Lines of metrics.jsonl left out: damaged, or not records the view can show."""

    @property
    def status(self) -> str:
        if self.stopped is not None and (self.updated is None
                                         or self.stopped.get("_mtime", 0) >= self.updated - 1):
            status, message = self.stopped.get("status"), self.stopped.get("message")
            return f"stopped (status {status}): {message}"
        if self.summary is not None:
            return "finished"
        if self.updated is None:
            return "no metrics yet"
        if time.time() - self.updated < RECENT_S:
            return "running"
        return "not running (no summary: interrupted?)"

    @property
    def finished(self) -> bool:
        return not self.status.startswith(("running", "no metrics"))

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of a train key, finite values only."""
        xs, ys = [], []
        for r in self.train:
            v = r.get(key)
            if isinstance(v, int | float) and math.isfinite(v):
                xs.append(float(r["step"]))
                ys.append(float(v))
        return xs, ys

    def spread(self) -> tuple[list[float], list[float]]:
        """Trust-ratio spread per logged step: max / min over the layers."""
        xs, ys = [], []
        for r in self.train:
            lo, hi = r.get("trust_ratio_min"), r.get("trust_ratio_max")
            if isinstance(lo, int | float) and isinstance(hi, int | float) and lo > 0:
                xs.append(float(r["step"]))
                ys.append(float(hi) / float(lo))
        return xs, ys


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _numbers(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_number(x) for x in v)


def _ranks_ok(r: dict[str, Any]) -> bool:
    lists = [r.get(k) for k in ("compute_s", "data_s", "sync_s")]
    shares = r.get("micro_batch_sizes")
    return (all(_numbers(x) for x in lists) and len({len(x) for x in lists}) == 1
            and (shares is None or isinstance(shares, list) and len(shares) == len(lists[0])))


_VALID = {  # what each kind the view shows needs besides its step
    "train": lambda r: True,
    "eval": lambda r: True,
    "ranks": _ranks_ok,
    "straggler": lambda r: (isinstance(r.get("rank"), int) and r["rank"] >= 0
                            and _number(r.get("ratio")) and _number(r.get("compute_s"))),
    "rebalance": lambda r: "old" in r and "new" in r,
    "batch_size": lambda r: "old" in r and "new" in r,
    "autoscale": lambda r: "old" in r and "new" in r,
    "sync_switch": lambda r: "old" in r and "new" in r,
    "relaunch": lambda r: isinstance(r.get("set"), dict),
}


def _usable(record: Any) -> bool | None:
    """True: a record the view shows; None: another kind (a policy's own), left out
    quietly; False: damaged or foreign."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return False
    check = _VALID.get(record["kind"])
    if check is None:
        return None
    return _number(record.get("step")) and bool(check(record))


def read_run(out: str | Path) -> RunView:
    """Read `OUT`; a half-written last line (a live run) is left out, and any other line
    the view cannot show is skipped and counted (`RunView.skipped`)."""
    out = Path(out)
    view = RunView(out)
    path = out / METRICS_FILE
    if path.is_file():
        view.updated = path.stat().st_mtime
        kinds = {"train": view.train, "eval": view.evals, "ranks": view.ranks,
                 "straggler": view.stragglers, "rebalance": view.rebalances,
                 "batch_size": view.batch_changes, "autoscale": view.autoscale,
                 "sync_switch": view.sync_switches, "relaunch": view.relaunches}
        text = path.read_bytes().decode("utf-8", errors="replace")
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                if i == len(lines) - 1:  # no newline yet: still being written
                    continue
                record = None
            usable = _usable(record)
            if usable:
                kinds[record["kind"]].append(record)
            elif usable is False:
                view.skipped += 1
    for name, attr in (("summary.json", "summary"), (STOPPED_FILE, "stopped")):
        try:
            data = json.loads((out / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if attr == "stopped":
            data["_mtime"] = (out / name).stat().st_mtime
        setattr(view, attr, data)
    return view


TREND = 32
"""Logged steps a trend (sparkline) shows: the latest ones."""


def sparkline(values: list[float], width: int = TREND, log: bool = False) -> str:
    """The last `width` values as block characters, scaled between their min and max (of
    their logarithms with `log`, when all are positive)."""
    vals = values[-width:]
    if log and vals and min(vals) > 0:
        vals = [math.log(v) for v in vals]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi <= lo:
        return SPARK[0] * len(vals)
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / (hi - lo) * len(SPARK)))]
                   for v in vals)


def _fmt(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.4g}"


def _metrics_table(view: RunView) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="training", title_justify="left", expand=False)
    for col, justify in (("", "left"), ("latest", "right"), ("min", "right"),
                         ("max", "right"),
                         (f"trend, last {TREND} logged steps (loss: log scale)", "left")):
        table.add_column(col, justify=justify)
    rows = [("loss", view.series("loss")), ("lr", view.series("lr")),
            ("global batch", view.series("global_batch_size")),
            ("noise scale", view.series("gns")),
            ("trust-ratio spread (max/min)", view.spread()),
            ("samples/s", view.series("samples_per_s"))]
    for name, (_, ys) in rows:
        if ys:
            table.add_row(name, _fmt(ys[-1]), _fmt(min(ys)), _fmt(max(ys)),
                          sparkline(ys, log=name == "loss"))
        else:
            table.add_row(name, "-", "-", "-", "[dim]not recorded[/dim]")
    for r in view.evals[-1:]:
        for key, v in r.items():
            if key not in ("kind", "step", "epoch") and isinstance(v, int | float):
                table.add_row(Text(f"test {key} (step {r['step']})"), _fmt(v), "", "", "")
    return table


def _ranks_table(view: RunView) -> Any:
    from rich.table import Table
    from rich.text import Text

    last = view.ranks[-1]
    flagged: dict[int, int] = {}
    for s in view.stragglers:
        flagged[int(s["rank"])] = int(s["step"])
    table = Table(title=f"per rank, mean seconds per step over the window ending at step "
                  f"{last['step']}", title_justify="left")
    table.add_column("rank")
    for col in ("step ms", "compute ms", "data ms", "sync ms", "micro batch"):
        table.add_column(col, justify="right")
    table.add_column("compute / others' median")
    compute = last["compute_s"]
    shares = last.get("micro_batch_sizes") or [None] * len(compute)
    for r, c in enumerate(compute):
        d, s = last["data_s"][r], last["sync_s"][r]
        others = sorted(x for q, x in enumerate(compute) if q != r)
        med = (others[len(others) // 2] if len(others) % 2 else
               sum(others[len(others) // 2 - 1:len(others) // 2 + 1]) / 2) if others else 0
        ratio = c / med if med else float("nan")
        mark = f"{ratio:.2f}x" if math.isfinite(ratio) else ""
        if r in flagged:
            mark = f"[bold red]STRAGGLER[/bold red] (flagged at step {flagged[r]}; now {mark})"
        elif ratio > 1.5:
            mark = f"[yellow]slow: {mark}[/yellow]"
        table.add_row(str(r), f"{1e3 * (c + d + s):.1f}", f"{1e3 * c:.1f}", f"{1e3 * d:.1f}",
                      f"{1e3 * s:.1f}", Text("-" if shares[r] is None else str(shares[r])), mark)
    return table


def render(view: RunView) -> Any:
    """The whole view as one rich renderable."""
    from rich.console import Group
    from rich.text import Text

    step = view.train[-1]["step"] if view.train else 0
    epoch = view.train[-1].get("epoch") if view.train else None
    head = Text.assemble((f"bigbatch monitor {view.out}", "bold"),
                         f"  {view.status}  step {step}",
                         f"  epoch {epoch:.2f}" if _number(epoch) else "")
    parts: list[Any] = [head, _metrics_table(view)]
    if view.ranks:
        parts.append(_ranks_table(view))
    events = [f"step {s['step']}: straggler rank {s['rank']} (host {s.get('host', '?')}), "
              f"{s['ratio']:.2f}x the others' median, action {s.get('action')}"
              for s in view.stragglers]
    events += [f"step {r['step']}: micro batches per rank {r['old']} -> {r['new']}"
               for r in view.rebalances]
    events += [f"step {c['step']}: global batch {c['old']} -> {c['new']} ({c.get('reason', '')})"
               for c in view.batch_changes]
    events += [f"step {a['step']}: workers {a['old']} -> {a['new']} ({a.get('reason', '')})"
               for a in view.autoscale]
    events += [f"step {w['step']}: synchronisation {w['old']} -> {w['new']} "
               f"({w.get('reason', '')})" for w in view.sync_switches]
    events += [f"step {r['step']}: relaunched with "
               + ", ".join(f"{k} = {v}" for k, v in r["set"].items())
               + f" ({r.get('reason', '')})" for r in view.relaunches]
    if events:
        parts.append(Text("events:\n  " + "\n  ".join(events[-8:])))
    if view.skipped:
        parts.append(Text(f"skipped {view.skipped} line{'s' if view.skipped > 1 else ''} of "
                          f"{METRICS_FILE} (damaged, or not a record this view shows)",
                          style="yellow"))
    return Group(*parts)
