"""report.md of the study: the results table and the prose around it.

Renders the dict that `bigbatch.study.report.collect` builds and results.json holds; the
analysis behind every number stays in `bigbatch.study.report`.
"""

from __future__ import annotations

import math
from typing import Any


def fmt_metric(value: float | None, metric: str) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.2f}%" if metric == "accuracy" else f"{value:.4f}"


def _num(value: float | None, spec: str = ".0f") -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _noise(r: dict[str, Any]) -> str:
    text = "no signal" if r.get("noise_scale_unresolved") else _num(r.get("noise_scale"))
    return text + ("*" if r.get("noise_scale_biased") else "")


def table(results: dict[str, Any]) -> str:
    """The seed-000-style table: strategy, global batch, epochs, metric, steps to target."""
    m, tgt = results["metric"], results["target"]
    label = "test accuracy" if m == "accuracy" else f"test {m}"
    head = ["strategy", "global batch", "epochs", label, "vs baseline", "steps",
            f"steps to {fmt_metric(tgt, m)}", "epochs to target", "peak LR", "noise scale",
            "wall s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = results["baseline"]
    for r in results["cells"]:
        if r.get("final") is None:
            rows.append(f"| {r['strategy']} | {r['global_batch_size']} | {r['status']} |"
                        + " |" * (len(head) - 3))
            continue
        delta = "—"
        if base is not None:
            d = r["final"] - base["final"]
            delta = f"{100 * d:+.2f} pt" if m == "accuracy" else f"{d:+.4f}"
        reached = r.get("steps_to_target")
        stt = _num(reached) if reached is not None else f"not reached (> {r['steps']})"
        rows.append(f"| {r['strategy']} | {r['global_batch_size']} | {r['epochs']:g} | "
                    f"{fmt_metric(r['final'], m)} | {delta} | {r['steps']} | {stt} | "
                    f"{_num(r.get('epochs_to_target'), '.2f')} | {_num(r['peak_lr'], '.4g')} | "
                    f"{_noise(r)} | "
                    f"{_num(r.get('wall_time_s'))} |")
    return "\n".join(rows)


def markdown(results: dict[str, Any], figures: dict[str, str]) -> str:
    m, c = results["metric"], results["config"]
    base, rec = results["baseline"], results["recipe"]
    lines = [f"# Batch-size study: {results['task']} / {results['model']}", ""]
    if results.get("command"):
        lines += ["Command:", "", "```", results["command"], "```", ""]
    opts = ", ".join(f"{k}={v}" for k, v in c["task_options"].items()) or "defaults"
    lines += [f"Task options: {opts}. Every cell: {c['epochs']:g} epochs, seed {c['seed']}, "
              f"{c['nproc']} worker(s), micro-batch {c['micro_batch_size']} (larger batches merge "
              f"gradients), warmup {c['warmup_epochs']:g} epochs for scaled rules. Report written "
              f"{results['created']} with torch {results['environment']['torch']} "
              f"({_threads(results)}); training time of all cells "
              f"{results['total_wall_s'] / 60:.1f} min.", "",
              f"Base recipe: {rec['optimizer']} at batch {rec['base_batch_size']}, LR "
              f"{rec['base_lr']:g}, weight decay {rec['weight_decay']:g}, {rec['decay']} decay.", ""]
    lines += [f"- **{s}**: {rule}; {results['settings'][s]}" for s, rule in results["rules"].items()]
    lines.append("")
    if base is not None:
        lines.append(f"Baseline: {base['strategy']} at batch {base['global_batch_size']}, "
                     f"{fmt_metric(base['final'], m)}. Target: {fmt_metric(results['target'], m)}"
                     f"{'' if c['target'] is not None else ' (baseline ' + ('- 1 point' if m == 'accuracy' else '+ 0.05') + ')'}"
                     f"; tolerance for keeping accuracy: {results['tolerance']:g}.")
    elif results.get("no_baseline"):
        lines.append(f"**{results['no_baseline']}**")
    lines += ["", table(results), "",
              "Steps to target are interpolated linearly between the two test evaluations "
              "around the first crossing. Noise scale: B_simple = tr(Sigma)/|G|^2 (McCandlish et "
              "al. 2018) as the ratio of the means of its two estimates over the second half "
              "of training, in samples; * marks the biased consecutive-steps estimate (cells "
              "without gradient merge); no signal: the |G|^2 estimate averaged <= 0, a noise "
              "scale beyond what these batches resolve (counted as infinite). A pair of batches "
              "counts as below the critical batch when their geometric mean is.", ""]
    bc = results["critical_batch"]
    lines += ["## What this run found", ""]
    if bc is not None:
        lines.append(f"Measured critical batch (median late-training noise scale over "
                     f"{results['critical_batch_from']}): **{bc:.0f}** samples.")
    for name, fit in results["fits"].items():
        if fit:
            lines.append(f"Fit of S = S_min (1 + B_noise/B) to {name}'s steps to target: S_min = "
                         f"{fit['s_min']:.0f}, B_noise = {fit['b_noise']:.0f}.")
    lines.append("")
    for claim in results["claims"]:
        budget = results.get("budget")
        verdict = claim["verdict"].upper() + (f" ({budget})" if budget else "")
        lines += [f"- **{verdict}** — {claim['claim']}: {claim['why']}."]
        for r in claim.get("rows", []):
            lines.append(f"  - batch {r['global_batch_size']}: sgd {_signed(-r['sgd_loss'], m)}, "
                         f"{r['layerwise']} {_signed(-r['layerwise_loss'], m)} vs baseline")
        for p in claim.get("pairs", []):
            lines.append(f"  - {p['strategy']} {p['from']} -> {p['to']} ({p['region']} B_crit): "
                         f"efficiency {'<= ' if p['upper_bound'] else ''}{p['efficiency']:.2f}")
    failed = [r for r in results["cells"] if r["status"] in ("failed", "missing")]
    for r in failed:
        lines.append(f"- cell {r['strategy']}@{r['global_batch_size']}: {r['status']} "
                     f"{r.get('error', '')}")
    lines += ["", "## Figures", ""]
    lines += [f"![{title}]({name})\n" for name, title in figures.items()]
    return "\n".join(lines) + "\n"


def _threads(results: dict[str, Any]) -> str:
    n = results["environment"]["threads"]
    return f"{n} thread{'' if n == 1 else 's'} per worker"


def _signed(delta: float, metric: str) -> str:
    return f"{100 * delta:+.2f} pt" if metric == "accuracy" else f"{delta:+.4f}"
