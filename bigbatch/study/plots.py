"""The study's PNG figures (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MARKERS = {"sgd": "o", "lars": "s", "lamb": "D", "adascale": "^", "kfac": "P", "muon": "X"}
STYLES = {"sgd": "-", "lars": "--", "lamb": "-.", "adascale": ":", "kfac": (0, (5, 1, 1, 1)),
          "muon": (0, (3, 1, 1, 1, 1, 1))}
#: A growing batch's own marker, drawn large and unjoined in its base strategy's colour.
GROWING = {"adaptive": "*", "seesaw": "X", "goodput": "h", "doubling": "p"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _metric_label(results: dict[str, Any]) -> str:
    m = results["metric"]
    return "test accuracy" if m == "accuracy" else f"test {m} (lower is better)"


def _batch_colors(results: dict[str, Any]) -> dict[int, Any]:
    plt = _pyplot()
    batches = sorted({c["global_batch_size"] for c in results["cells"]})
    cmap = plt.get_cmap("viridis")
    n = max(1, len(batches) - 1)
    return {b: cmap(0.9 * i / n) for i, b in enumerate(batches)}


def _strategies(results: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(c["strategy"] for c in results["cells"]))


def _rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells over seeds (results.json before seeds has only `cells`)."""
    return results.get("rows") or results["cells"]


def _base_colors(results: dict[str, Any]) -> dict[str, Any]:
    """One colour per base strategy, shared by its fixed line and its growing markers."""
    plt = _pyplot()
    bases = dict.fromkeys(n.partition("@")[0] for n in _strategies(results))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {b: cycle[i % len(cycle)] for i, b in enumerate(bases)}


def _std(r: dict[str, Any], key: str) -> float:
    sp = (r.get("spread") or {}).get(key)
    return (sp or {}).get("std") or 0.0


def _growing_points(ax: Any, results: dict[str, Any], y_key: str, colors: dict[str, Any],
                    fallback: str | None = None) -> None:
    """Each growing row as its schedule's marker at its average batch (up to the target
    where it reached it: steps x that batch = its samples to target, as for a fixed
    batch), with the seeds' standard deviation as error bars."""
    for r in _rows(results):
        base, at, schedule = r["strategy"].partition("@")
        if not at or r.get("final") is None:
            continue
        y = r.get(y_key)
        reached = y is not None
        if not reached and fallback is None:
            continue
        x = ((r.get("average_batch_to_target") if reached and y_key != "final" else None)
             or r.get("average_batch"))
        if not x:
            continue
        y = y if reached else r.get(fallback)
        ax.errorbar([x], [y], yerr=[_std(r, y_key)] if reached else None,
                    marker=GROWING.get(schedule, "*"), ms=13, ls="none",
                    color=colors.get(base), mec="black" if reached else "red",
                    mfc=colors.get(base) if reached else "none",
                    label=f"{r['strategy']} ≤{r['global_batch_size']}"
                          + ("" if reached else ": not reached (budget shown)"))


def plot_curves(results: dict[str, Any], path: Path) -> None:
    """Test metric vs optimizer step, one panel per strategy, one line per batch."""
    plt = _pyplot()
    names, colors = _strategies(results), _batch_colors(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.2), sharey=True,
                             squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        labelled = set()
        for c in results["cells"]:
            if c["strategy"] != name or not c.get("evals"):
                continue
            pts = [(s, v) for s, _, v in c["evals"] if v is not None]
            b = c["global_batch_size"]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", ms=4, color=colors[b],
                    label=None if b in labelled else f"batch {'≤' if '@' in name else ''}{b}")
            labelled.add(b)
        if results["target"] is not None:
            ax.axhline(results["target"], color="grey", ls="--", lw=1, label="target")
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(_metric_label(results))
    if results["metric"] == "accuracy":
        lo = min((v for c in results["cells"] for *_, v in c.get("evals") or [] if v is not None),
                 default=0.0)
        axes[0][0].set_ylim(max(0.0, lo - 0.02), 1.0)
    axes[0][-1].legend(fontsize=8, loc="lower right" if results["higher_is_better"] else "upper right")
    fig.suptitle(f"{results['task']} / {results['model']}: test metric during training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_steps(results: dict[str, Any], path: Path) -> None:
    """Steps to target vs global batch (log-log), perfect scaling and the critical batch;
    the mean over seeds with their standard deviation, and growing batches as their own
    markers at their average batch."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    colors = _base_colors(results)
    anchor = None
    for name in _strategies(results):
        if "@" in name:
            continue
        cells = sorted((c for c in _rows(results) if c["strategy"] == name and c.get("steps")),
                       key=lambda c: c["global_batch_size"])
        hit = [c for c in cells if c.get("steps_to_target")]
        miss = [(c["global_batch_size"], c["steps"]) for c in cells if not c.get("steps_to_target")]
        if hit:
            ax.errorbar([c["global_batch_size"] for c in hit], [c["steps_to_target"] for c in hit],
                        yerr=[_std(c, "steps_to_target") for c in hit], capsize=2,
                        marker=MARKERS.get(name, "o"), ls=STYLES.get(name, "-"),
                        color=colors[name], label=name)
            first = (hit[0]["global_batch_size"], hit[0]["steps_to_target"])
            if anchor is None or first[0] < anchor[0]:
                anchor = first
        if miss:
            ax.scatter(*zip(*miss, strict=True), marker=MARKERS.get(name, "o"), facecolors="none",
                       edgecolors="red", s=60, label=f"{name}: not reached (budget shown)")
    _growing_points(ax, results, "steps_to_target", colors, fallback="steps")
    batches = sorted({c["global_batch_size"] for c in results["cells"]})
    bc = results["critical_batch"]
    if anchor is not None and len(batches) > 1:
        b0, s0 = anchor
        ax.plot(batches, [s0 * b0 / b for b in batches], color="grey", lw=1, ls="--",
                label="perfect scaling")
        if bc:
            s_min = s0 / (1 + bc / b0)
            ax.plot(batches, [s_min * (1 + bc / b) for b in batches], color="black", lw=1, ls=":",
                    label="S_min (1 + B_crit / B)")
    if bc:
        ax.axvline(bc, color="tab:red", lw=1.2, alpha=0.7, label=f"critical batch ~ {bc:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch size (growing batches: their average)")
    ax.set_ylabel("optimizer steps to target")
    from bigbatch.study.markdown import fmt_metric

    ax.set_title(f"steps to {results['metric']} {fmt_metric(results['target'], results['metric'])}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def smoothed_noise(series: list[list[Any]]) -> tuple[list[float], list[float]]:
    """(epochs, B_simple) with the ratio of rolling means of tr(Sigma) and |G|^2 over about
    half an epoch of log lines (the per-line values of small batches are very noisy)."""
    rows = [r for r in series if len(r) >= 6 and r[4] is not None and r[5]]
    if not rows:
        return [r[1] for r in series], [r[2] for r in series]
    span = max(rows[-1][1] - rows[0][1], 1e-9)
    w = max(1, round((len(rows) - 1) / span / 2))
    xs, ys = [], []
    for i in range(len(rows)):
        win = rows[max(0, i - w + 1): i + 1]
        g = sum(r[5] for r in win)
        if g > 0:
            xs.append(rows[i][1])
            ys.append(max(sum(r[4] for r in win), 0.0) / g)
    return xs, ys


def plot_noise(results: dict[str, Any], path: Path) -> None:
    """Measured gradient noise scale B_simple over training, one line per cell."""
    plt = _pyplot()
    colors = _batch_colors(results)
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for c in results["cells"]:
        xs, ys = smoothed_noise(c.get("noise_scale_series") or [])
        pos = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
        if not pos:
            continue
        biased = any(r[3] for r in c["noise_scale_series"])
        seed = f" s{c['seed']}" if c.get("seed") else ""
        ax.plot([p[0] for p in pos], [p[1] for p in pos],
                ls=STYLES.get(c["strategy"].partition("@")[0], "-"),
                color=colors[c["global_batch_size"]], lw=1.2,
                label=f"{c['strategy']} at {c['global_batch_size']}{seed}{' *' if biased else ''}")
    if results["critical_batch"]:
        ax.axhline(results["critical_batch"], color="tab:red", lw=1, ls="--",
                   label=f"critical batch ~ {results['critical_batch']:.0f}")
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("noise scale B_simple (samples)")
    ax.set_title("gradient noise scale during training (* biased estimator)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _zoom(ax: Any, results: dict[str, Any]) -> None:
    """Keep the axis near the baseline (where the tolerance is visible); a cell far off it is
    drawn on the edge with its value written beside it."""
    base, tol = results["baseline"], results["tolerance"]
    if base is None:
        return
    higher, b = results["higher_is_better"], base["final"]
    span = 20 * tol
    lo, hi = (b - span, min(1.0, b + span / 4)) if higher else (b - span / 4, b + span)
    if results["metric"] == "accuracy":
        hi = min(hi, 1.0)
    for c in _rows(results):
        v = c.get("final")
        if v is None or lo <= v <= hi:
            continue
        edge = lo if v < lo else hi
        ax.scatter([c["global_batch_size"]], [edge], marker="v" if v < lo else "^", color="red",
                   zorder=5, clip_on=False)
        from bigbatch.study.markdown import fmt_metric

        ax.annotate(f"{c['strategy']}: {fmt_metric(v, results['metric'])}",
                    (c["global_batch_size"], edge), textcoords="offset points",
                    xytext=(-6, 8 if v < lo else -14), ha="right", fontsize=8, color="red")
    ax.set_ylim(lo, hi)


def plot_final(results: dict[str, Any], path: Path) -> None:
    """Final test metric vs global batch, with the baseline and the tolerance band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    colors = _base_colors(results)
    for name in _strategies(results):
        if "@" in name:
            continue
        pts = sorted((c["global_batch_size"], c["final"], _std(c, "final")) for c in _rows(results)
                     if c["strategy"] == name and c.get("final") is not None)
        if pts:
            xs, ys, es = zip(*pts, strict=True)
            ax.errorbar(xs, ys, yerr=es, capsize=2, marker=MARKERS.get(name, "o"),
                        ls=STYLES.get(name, "-"), color=colors[name], label=name)
    _growing_points(ax, results, "final", colors)
    base, tol = results["baseline"], results["tolerance"]
    if base is not None:
        ax.axhline(base["final"], color="grey", lw=1, label="small-batch baseline")
        edge = base["final"] - tol if results["higher_is_better"] else base["final"] + tol
        ax.axhspan(min(edge, base["final"]), max(edge, base["final"]), color="grey", alpha=0.2,
                   label=f"tolerance {tol:g}")
    _zoom(ax, results)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch size")
    ax.set_ylabel(_metric_label(results))
    ax.set_title(f"final test metric after {results['config']['epochs']:g} epochs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FIGURES = {
    "final_metric.png": ("final test metric vs batch", plot_final),
    "steps_to_target.png": ("steps to target vs batch", plot_steps),
    "curves.png": ("test metric vs step", plot_curves),
    "noise_scale.png": ("noise scale over training", plot_noise),
}


def plot_all(results: dict[str, Any], out: Path) -> dict[str, str]:
    """Write every figure into `out`; returns {file name: title}."""
    for name, (_, fn) in FIGURES.items():
        fn(results, Path(out) / name)
    return {name: title for name, (title, _) in FIGURES.items()}
