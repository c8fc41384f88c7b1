"""A study's cells over seeds: one row per (strategy, global batch) with each number as
the mean over its seeds and its spread (sample standard deviation, min, max, count).

A seed that never reached the target has no steps to it: the row's steps, samples and
epochs to target are the mean over its seeds only when every finished seed reached it
(`reached` counts those that did), so that a mean is never taken over the lucky seeds
alone. The claims, the headline and the figures read these rows; results.json keeps the
cells of each seed beside them.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["MEASURES", "TO_TARGET", "aggregate", "spread"]

TO_TARGET = ("steps_to_target", "samples_to_target", "epochs_to_target", "average_batch_to_target")
"""Measures that exist only where a seed reached the target."""
MEASURES = ("final", "steps", "epochs", "samples", "average_batch", "wall_time_s", "peak_lr",
            *TO_TARGET)
#: Copied from the first seed's cell: the same for every seed.
SHARED = ("strategy", "global_batch_size", "schedule", "start_batch_size", "optimizer",
          "micro_batch_size", "k_steps")


def spread(values: list[float]) -> dict[str, float] | None:
    """Mean, sample standard deviation (n - 1; None for one value), min, max and n."""
    if not values:
        return None
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "n": len(values)}


def _noise(done: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of the seeds' resolved noise scales; "no signal" only when none resolved."""
    values = [c["noise_scale"] for c in done if c.get("noise_scale") is not None]
    return {"noise_scale": statistics.fmean(values) if values else None,
            "noise_scale_unresolved": not values and any(c.get("noise_scale_unresolved")
                                                        for c in done),
            "noise_scale_biased": any(c.get("noise_scale_biased") for c in done)}


def _status(cells: list[dict[str, Any]], done: list[dict[str, Any]]) -> str:
    states = {c["status"] for c in cells}
    if len(done) == len(cells):
        return states.pop() if len(states) == 1 else "ran"
    if not done:
        return "failed" if "failed" in states else "missing"
    return f"{len(done)} of {len(cells)} seeds"


def aggregate(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (strategy, global batch), in the cells' order (see the module)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["strategy"], c["global_batch_size"]), []).append(c)
    rows = []
    for members in groups.values():
        done = [c for c in members if c.get("final") is not None]
        row: dict[str, Any] = {k: members[0].get(k) for k in SHARED}
        row.update(seeds=[c.get("seed", 0) for c in members], finished=len(done),
                   status=_status(members, done), spread={}, **_noise(done))
        reached = [c for c in done if c.get("steps_to_target") is not None]
        row["reached"] = len(reached)
        for m in MEASURES:
            pool = reached if m in TO_TARGET else done
            s = spread([c[m] for c in pool if isinstance(c.get(m), int | float)
                        and math.isfinite(c[m])])
            if m in TO_TARGET and len(reached) < len(done):
                row[m] = None  # not every seed got there: no mean (the spread keeps those that did)
            else:
                row[m] = None if s is None else s["mean"]
            row["spread"][m] = s
        row["by_seed"] = {str(c.get("seed", 0)): {"final": c.get("final"),
                                                  "steps_to_target": c.get("steps_to_target"),
                                                  "samples_to_target": c.get("samples_to_target")}
                          for c in done}
        rows.append(row)
    return rows
