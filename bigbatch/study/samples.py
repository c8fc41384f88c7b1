"""Samples a cell trained on up to each optimizer step, from its metrics.jsonl.

A fixed batch trains `step x batch` samples; a growing one (`batch.schedule`, goodput,
noise_scale_doubling) changes the batch at the steps its `{"kind": "batch_size", "step",
"old", "new"}` lines name: the step that logged a change ran at `old`, the next at `new`.
So samples to a target are exact at every evaluation, and interpolated between two
evaluations as steps are (`steps_to_target` on (samples, metric) points).
"""

from __future__ import annotations

from typing import Any

__all__ = ["batch_changes", "samples_at"]


def batch_changes(lines: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """The run's `(step, old, new)` batch changes in step order (a resumed run that wrote a
    change twice counts it once)."""
    seen = {(int(d["step"]), int(d["old"]), int(d["new"])) for d in lines
            if d.get("kind") == "batch_size" and {"step", "old", "new"} <= d.keys()}
    return sorted(seen)


def samples_at(steps: list[float], start: int, changes: list[tuple[int, int, int]]) -> list[float]:
    """Samples trained after each of `steps` optimizer steps, for a run that started at global
    batch `start` and changed it as `changes` say; fractional steps (an interpolated
    crossing) count their fraction of a step at the batch of that step."""
    segments, step0, batch = [], 0, start  # (first step, last step, batch)
    for step, _, new in changes:
        segments.append((step0, step, batch))
        step0, batch = step, new
    segments.append((step0, float("inf"), batch))
    out = []
    for s in steps:
        out.append(sum(b * (min(s, hi) - lo) for lo, hi, b in segments if s > lo))
    return out
