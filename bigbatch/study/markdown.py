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


def _pm(r: dict[str, Any], key: str, spec: str = ".0f", scale: float = 1.0) -> str:
    """A row's mean of `key`, with "± std" over its seeds where there are several."""
    value, sp = r.get(key), (r.get("spread") or {}).get(key)
    text = _num(None if value is None else scale * value, spec)
    if value is not None and sp and sp.get("std") is not None:
        text += f" ± {format(scale * sp['std'], spec)}"
    return text


def _final(r: dict[str, Any], metric: str) -> str:
    sp = (r.get("spread") or {}).get("final")
    text = fmt_metric(r["final"], metric)
    if sp and sp.get("std") is not None:
        text += f" ± {100 * sp['std']:.2f}" if metric == "accuracy" else f" ± {sp['std']:.4f}"
    return text


def _to_target(r: dict[str, Any], key: str, spec: str = ".0f") -> str:
    """Steps (samples, epochs) to target: the mean when every seed reached it, else how many
    did (and their mean), else "not reached" with the budget."""
    finished, reached = r.get("finished", 1), r.get("reached", int(r.get(key) is not None))
    if reached == finished:
        return _pm(r, key, spec)
    if reached == 0:
        return f"not reached (> {r['steps']:.0f})" if key == "steps_to_target" else "—"
    sp = (r.get("spread") or {}).get(key)
    return f"{reached} of {finished} seeds" + (f": {format(sp['mean'], spec)}" if sp else "")


def _batch(r: dict[str, Any]) -> str:
    """The fixed batch, or a growing one's start -> ceiling."""
    start = r.get("start_batch_size")
    return f"{start}→{r['global_batch_size']}" if start else str(r["global_batch_size"])


def table(results: dict[str, Any]) -> str:
    """The seed-000-style table, one row per (strategy, batch) over the study's seeds:
    strategy, global batch, epochs, metric, steps and samples to target, average batch."""
    m, tgt = results["metric"], results["target"]
    label = "test accuracy" if m == "accuracy" else f"test {m}"
    head = ["strategy", "global batch", "epochs", label, "vs baseline", "steps",
            f"steps to {fmt_metric(tgt, m)}", "samples to target", "average batch",
            "epochs to target", "peak LR", "noise scale", "wall s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = results["baseline"]
    for r in results.get("rows") or results["cells"]:
        if r.get("final") is None:
            rows.append(f"| {r['strategy']} | {_batch(r)} | {r['status']} |"
                        + " |" * (len(head) - 3))
            continue
        delta = "—"
        if base is not None:
            d = r["final"] - base["final"]
            delta = f"{100 * d:+.2f} pt" if m == "accuracy" else f"{d:+.4f}"
        rows.append(f"| {r['strategy']} | {_batch(r)} | {r['epochs']:g} | "
                    f"{_final(r, m)} | {delta} | {_pm(r, 'steps')} | "
                    f"{_to_target(r, 'steps_to_target')} | {_to_target(r, 'samples_to_target')} | "
                    f"{_pm(r, 'average_batch')} | {_to_target(r, 'epochs_to_target', '.2f')} | "
                    f"{_num(r['peak_lr'], '.4g')} | {_noise(r)} | {_pm(r, 'wall_time_s')} |")
    return "\n".join(rows)


def _saved(against: dict[str, Any]) -> str:
    if against.get("saved") is None:
        return against["why"]
    sp, ref = against["saved"], against
    text = f"**{100 * sp['mean']:.0f}%**" + (f" ± {100 * sp['std']:.0f}%" if sp["std"] is not None
                                             else "")
    ratio = against.get("samples_ratio")
    return (f"{text} ({ref['strategy']} {ref['global_batch_size']}: {ref['steps_to_target']:.0f}"
            f" steps; samples x{ratio:.2f})" if ratio else
            f"{text} ({ref['strategy']} {ref['global_batch_size']}: "
            f"{ref['steps_to_target']:.0f} steps)")


def headline_lines(results: dict[str, Any]) -> list[str]:
    """"Steps saved at equal quality": the adaptive rows against the fixed batches."""
    rows, m = results.get("headline") or [], results["metric"]
    if not rows:
        return []
    n = len(results.get("seeds") or [0])
    lines = ["## Steps saved at equal quality", "",
             "| strategy | global batch | steps to target | saved vs baseline | saved vs best "
             "fixed batch | average batch | final | within tolerance |", "|" + "---|" * 8]
    for h in rows:
        std = h.get("steps_to_target_std")
        steps = (f"{h['steps_to_target']:.0f}" + (f" ± {std:.0f}" if std is not None else "")
                 if h["steps_to_target"] is not None else
                 f"reached in {h['reached']} of {h['seeds']} seeds" if h["reached"] else
                 "not reached")
        keeps = ("—" if "keeps_quality" not in h else
                 ("yes" if h["keeps_quality"] else "no") + f" ({_signed(-h['final_loss'], m)})")
        lines.append(f"| {h['strategy']} | {_batch(h)} | {steps} | {_saved(h['vs_baseline'])} | "
                     f"{_saved(h['vs_best_fixed'])} | {_num(h['average_batch'])} | "
                     f"{fmt_metric(h['final'], m)} | {keeps} |")
    lines += ["", "Saved: 1 - steps to target / the reference's, per seed against the "
              "reference's run of the same seed, then "
              + (f"mean ± sample standard deviation over {n} seeds" if n > 1 else "one seed")
              + "; samples x: the row's samples to target over the reference's. The best fixed "
              "batch is the base strategy's (sgd's for AdaScale) with the fewest steps to "
              "target among those that reached it in every seed. Within tolerance: the final "
              f"quality is within {results['tolerance']:g} of the baseline's, so the steps "
              "were saved at equal quality.", ""]
    return lines


def markdown(results: dict[str, Any], figures: dict[str, str]) -> str:
    m, c = results["metric"], results["config"]
    base, rec = results["baseline"], results["recipe"]
    lines = [f"# Batch-size study: {results['task']} / {results['model']}", ""]
    if results.get("command"):
        lines += ["Command:", "", "```", results["command"], "```", ""]
    opts = ", ".join(f"{k}={v}" for k, v in c["task_options"].items()) or "defaults"
    seeds = results.get("seeds") or [c["seed"]]
    seed_text = (f"seed {seeds[0]}" if len(seeds) == 1 else
                 f"seeds {', '.join(map(str, seeds))} (each number: mean ± sample standard "
                 "deviation over them)")
    lines += [f"Task options: {opts}. Every cell: {c['epochs']:g} epochs, {seed_text}, "
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
                     f"{fmt_metric(base['final'], m)}"
                     f"{_over(base.get('seeds'))}. Target: {fmt_metric(results['target'], m)}"
                     f"{'' if c['target'] is not None else ' (baseline ' + ('- 1 point' if m == 'accuracy' else '+ 0.05') + ')'}"
                     f"; tolerance for keeping accuracy: {results['tolerance']:g}.")
    elif results.get("no_baseline"):
        lines.append(f"**{results['no_baseline']}**")
    lines += [""] + [f"- left out: {why}" for why in results.get("skipped") or []]
    lines += ["", *headline_lines(results), table(results), "",
              "Steps to target are interpolated linearly between the two test evaluations "
              "around the first crossing, samples to target likewise between the samples "
              "trained by then (a growing batch's samples per step vary); average batch: "
              "samples / steps of the whole run. A growing batch's global batch reads "
              "start→ceiling; it is evaluated as often in steps as at its start, and at least "
              "once per epoch. Noise scale: B_simple = tr(Sigma)/|G|^2 (McCandlish et "
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
        lines.append(f"- cell {r['strategy']} at batch {r['global_batch_size']}, seed "
                     f"{r.get('seed', c['seed'])}: {r['status']} {r.get('error', '')}")
    lines += ["", "## Figures", ""]
    lines += [f"![{title}]({name})\n" for name, title in figures.items()]
    return "\n".join(lines) + "\n"


def _over(seeds: list[int] | None) -> str:
    return f" (mean of {len(seeds)} seeds)" if seeds and len(seeds) > 1 else ""


def _threads(results: dict[str, Any]) -> str:
    n = results["environment"]["threads"]
    return f"{n} thread{'' if n == 1 else 's'} per worker"


def _signed(delta: float, metric: str) -> str:
    return f"{100 * delta:+.2f} pt" if metric == "accuracy" else f"{delta:+.4f}"
