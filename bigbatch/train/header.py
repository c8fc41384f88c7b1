"""The lines a run prints before its first step: the launch table (who runs where), the
strategy's overview for a new run
(with the warmup fitted to a short try and the LR the range test found), or where a
resume picks up; then the weight-decay / trust-ratio exclusion summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bigbatch.config.elastic import resume_line
from bigbatch.engine.optimizer import exclusion_summary
from bigbatch.train.lr_phase import FoundLR

__all__ = ["autoscale_lines", "header_lines"]

_DECISIONS_SHOWN = 4


def autoscale_lines(out: Path) -> list[str]:
    """The worker-count decisions of `--nproc MIN:MAX` so far (``autoscale`` lines of
    metrics.jsonl, the last few), for the header of the segment they started."""
    try:
        text = (out / "metrics.jsonl").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "autoscale":
            found.append(rec)
    return [f"autoscale: step {r.get('step')}: workers {r.get('old')} -> {r.get('new')} "
            f"({r.get('reason', '')})" for r in found[-_DECISIONS_SHOWN:]]


def header_lines(run: Any, strategy: Any, out: Path, sampler: Any, saved: Any,
                 steps_per_epoch: int | None, total_steps: int, lr_found: dict | None,
                 warmup_note: str | None, *, resumed: bool,
                 data_note: str | None = None, fleet: str | None = None,
                 launch: list[str] | None = None) -> list[str]:
    """What `bigbatch train` prints under its progress bar before training; `launch`
    (`bigbatch.train.launch_table.launch_lines`): who runs where, first, new run or resumed;
    `data_note` (the task's `data_note()`) says which data set it trains on; `fleet`: the
    Fleet strategy file the strategy came from, whose translation precedes the overview."""
    data = [*(launch or []), *([data_note] if data_note else [])]
    if resumed:
        lines = [*data, f"resuming {out} from step {run.step} (epoch {sampler.epoch}, "
                 f"sample {sampler.position})"]
        moved = saved is not None and resume_line(saved, run.plan, run.world.world_size,
                                                  run.unit_batch_size, strategy)
        return lines + ([moved] if moved else []) + autoscale_lines(out)
    if fleet is not None:
        from bigbatch.config.fleet import translate

        data.append(translate(fleet).table())
    lines = [*data, strategy.overview(run.world.world_size, steps_per_epoch=steps_per_epoch,
                                      total_steps=total_steps, lr_find=lr_found)]
    if warmup_note is not None:
        lines.append(warmup_note)
    if lr_found is not None:
        lines.append(FoundLR.from_dict(lr_found).line())
    pipe = run.pipeline  # each stage holds a part of the model: count it whole
    whole = {} if pipe is None else {"group": run.mesh.pp_group,
                                     "skip": pipe.counted_elsewhere()}
    return lines + [exclusion_summary(run.optimizer, **whole)]
