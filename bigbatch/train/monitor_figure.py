"""`bigbatch monitor OUT --png`: the monitor's view as one figure, `OUT/monitor.png`
(matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from bigbatch.train.monitor import RunView

__all__ = ["FIGURE_FILE", "write_figure"]

FIGURE_FILE = "monitor.png"
LOG_SCALE = ("loss", "gns", "spread")
"""Panels on a log scale (when every value is positive): a loss falls over decades."""


def write_figure(view: RunView, path: Path | None = None) -> Path:
    """Six panels: loss, LR, global batch, noise scale, trust-ratio spread, and per-rank
    compute time per step with stragglers marked. Returns the file written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    path = Path(path) if path is not None else view.out / FIGURE_FILE
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    panels = [("loss", view.series("loss"), "train loss"),
              ("lr", view.series("lr"), "learning rate"),
              ("global_batch_size", view.series("global_batch_size"), "global batch"),
              ("gns", view.series("gns"), "noise scale B_simple (samples)"),
              ("spread", view.spread(), "trust-ratio spread (max / min)")]
    for ax, (key, (xs, ys), title) in zip(axes.flat, panels, strict=False):
        ax.set_title(title)
        ax.set_xlabel("step")
        if ys:
            ax.plot(xs, ys, lw=1.2, drawstyle="steps-post" if key == "global_batch_size" else
                    "default")
            if key == "loss" and view.evals:
                ev = [(r["step"], r["loss"]) for r in view.evals
                      if isinstance(r.get("loss"), int | float)]
                if ev:
                    ax.plot(*zip(*ev, strict=True), "o-", ms=3, label="test")
                    ax.legend()
            if key in LOG_SCALE and min(ys) > 0:
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center",
                    transform=ax.transAxes, color="grey")
    ax = axes.flat[5]
    ax.set_title("compute per step by rank (x: straggler)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    if view.ranks:
        steps = [r["step"] for r in view.ranks]
        n = len(view.ranks[-1]["compute_s"])
        for rank in range(n):
            ms = [1e3 * r["compute_s"][rank] if rank < len(r["compute_s"]) else float("nan")
                  for r in view.ranks]
            ax.plot(steps, ms, lw=1.2, label=f"rank {rank}")
        for s in view.stragglers:
            ax.plot(s["step"], 1e3 * s["compute_s"], "x", color="red", ms=10, mew=2)
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no per-rank timings\n(adaptive.policies = [\"straggler\"])",
                ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.suptitle(f"{view.out}: {view.status}".replace("$", r"\$"), fontsize=10)  # no mathtext
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
