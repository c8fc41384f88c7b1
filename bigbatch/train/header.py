"""The lines a run prints before its first step: the launch table (who runs where), the
strategy's overview for a new run
(with the warmup fitted to a short try and the LR the range test found), or where a
resume picks up; then the weight-decay / trust-ratio exclusion summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bigbatch.config.elastic import resume_line
from bigbatch.engine.optimizer import exclusion_summary
from bigbatch.train.lr_phase import FoundLR

__all__ = ["header_lines"]


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
        return lines + ([moved] if moved else [])
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
