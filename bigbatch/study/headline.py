"""The study's headline: optimizer steps saved at equal quality by the adaptive methods.

For every row of a growing batch (`"<base>@<schedule>"`) and of AdaScale, the steps it
took to the target against two fixed-batch references: the small-batch baseline (the
recipe's optimizer at the recipe's batch or below) and the best fixed batch of the same
base strategy that reached the target in every seed (fewest mean steps; for AdaScale,
which scales the recipe's optimizer, the recipe's `sgd`). Per seed,
`saved = 1 - steps / reference steps`, with the reference's run of the same seed (its
mean where that seed did not reach the target or did not run), then mean and sample
standard deviation over the seeds. A row with a seed that never reached the target has
no saving: it says how many did. Beside it, whether its final quality is within the
study's tolerance of the baseline, since steps saved at a lost quality are not equal.
"""

from __future__ import annotations

from typing import Any

from bigbatch.study.claims import loss_vs
from bigbatch.study.schedules import split_name
from bigbatch.study.seeds import spread

__all__ = ["headline", "is_adaptive", "reference_strategy"]


def is_adaptive(name: str) -> bool:
    """Rows the headline measures: a growing batch, or AdaScale's LR gain."""
    base, schedule = split_name(name)
    return schedule is not None or base == "adascale"


def reference_strategy(name: str) -> str:
    """The fixed-batch strategy a row of `name` is compared with at its best batch."""
    base, schedule = split_name(name)
    return "sgd" if schedule is None and base == "adascale" else base


def _saved(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, float] | None:
    """Per-seed `1 - steps / reference steps` (see the module), over the row's seeds."""
    ref_steps = ref["steps_to_target"]
    values = []
    for seed, own in row["by_seed"].items():
        other = ref["by_seed"].get(seed, {}).get("steps_to_target") or ref_steps
        values.append(1.0 - own["steps_to_target"] / other)
    return spread(values)


def _against(row: dict[str, Any], ref: dict[str, Any] | None, missing: str) -> dict[str, Any]:
    out: dict[str, Any] = {"strategy": None, "saved": None}
    if ref is not None:
        out.update(strategy=ref["strategy"], global_batch_size=ref["global_batch_size"],
                   steps_to_target=ref["steps_to_target"],
                   samples_to_target=ref.get("samples_to_target"))
    if row["steps_to_target"] is None:
        return {**out, "why": ("target not reached in any seed" if not row["reached"] else
                               f"target reached in {row['reached']} of {row['finished']} seeds")}
    if ref is None:
        return {**out, "why": missing}
    samples, ref_samples = row.get("samples_to_target"), ref.get("samples_to_target")
    return {**out, "saved": _saved(row, ref), "why": None,
            "samples_ratio": samples / ref_samples if samples and ref_samples else None}


def headline(rows: list[dict[str, Any]], base: dict[str, Any] | None, tol: float,
             higher: bool) -> list[dict[str, Any]]:
    """One entry per adaptive row that finished: its steps to target, the saving against
    the baseline and against the best fixed batch of its reference strategy, its final
    quality against the baseline (see the module)."""
    fixed = [r for r in rows if not is_adaptive(r["strategy"])]
    out = []
    for row in rows:
        if not is_adaptive(row["strategy"]) or row.get("final") is None:
            continue
        name = reference_strategy(row["strategy"])
        reached = [r for r in fixed if r["strategy"] == name and r["steps_to_target"] is not None]
        best = min(reached, key=lambda r: r["steps_to_target"], default=None)
        base_ok = base if base is not None and base["steps_to_target"] is not None else None
        entry: dict[str, Any] = {
            "strategy": row["strategy"], "global_batch_size": row["global_batch_size"],
            "start_batch_size": row.get("start_batch_size"), "seeds": row["finished"],
            "reached": row["reached"], "steps_to_target": row["steps_to_target"],
            "steps_to_target_std": (row["spread"].get("steps_to_target") or {}).get("std")
            if row["steps_to_target"] is not None else None,
            "average_batch": row.get("average_batch"), "final": row["final"],
            "vs_baseline": _against(row, base_ok, "no small-batch baseline that reached the "
                                    "target"),
            "vs_best_fixed": _against(row, best, f"no fixed-batch {name} cell reached the "
                                      "target in every seed"),
        }
        if base is not None:
            loss = loss_vs(row["final"], base["final"], higher)
            entry.update(final_loss=loss, keeps_quality=loss <= tol)
        out.append(entry)
    return out
