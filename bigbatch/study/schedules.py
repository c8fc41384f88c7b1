"""The study's growing-batch strategies: `"<base>@<schedule>"`, a base strategy of
`bigbatch.study.rules` whose global batch moves during the run.

A cell's batch from `batches` is the largest the batch may reach (the ceiling); the run
starts at the recipe's base batch, or at `batch.start_batch_size` when the study's `[set]`
gives one for the strategy (`"lars@adaptive" = ["batch.start_batch_size=512"]`): one knob
for all four schedules, though goodput and noise_scale_doubling spell the start as their
configured global batch. A ceiling at or below the start would be a fixed batch, which
is the base strategy's own cell: such a cell is left out of the grid (`NoGrowth`).
"""

from __future__ import annotations

import copy
from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["SCHEDULES", "NoGrowth", "cell_overrides", "check_name", "dir_name",
           "scheduled_strategy", "split_name", "valid_forms"]

SCHEDULES = {
    "adaptive": 'batch.schedule = "adaptive": doubles while twice the batch is within '
                "batch.noise_scale_fraction of the measured noise scale (McCandlish et al. 2018)",
    "seesaw": 'batch.schedule = "seesaw": doubles wherever the decay halves the LR '
              "(Meterez et al. 2025)",
    "goodput": 'adaptive.batch_size = "goodput": Pollux picks the batch between the start and '
               "the ceiling for the most progress per second (Qiao et al. 2021)",
    "doubling": 'adaptive.policies = ["noise_scale_doubling"]: doubles each time the noise '
                "scale has doubled since the batch was set (KungFu, Mai et al. 2020)",
}
"""Schedule suffix -> what the cell sets, for names and the report's rules."""

DECISION_INTERVAL = 10
"""goodput and noise_scale_doubling decide every this many optimizer steps instead of
`adaptive.interval_steps`' 100: batch.schedule_interval_steps' default, so that the four
schedules decide equally often, and a cell of a few hundred steps decides at all."""

START_KEY = "batch.start_batch_size"


class NoGrowth(ConfigError):
    """A growing strategy's cell whose ceiling is at or below its start: nothing to grow."""


def split_name(name: str) -> tuple[str, str | None]:
    """`"lars@seesaw"` -> `("lars", "seesaw")`; `"lars"` -> `("lars", None)`."""
    base, at, schedule = name.partition("@")
    return (base, schedule) if at else (name, None)


def valid_forms(bases: tuple[str, ...]) -> str:
    """The strategy names a study accepts, in one line for error messages."""
    return (f"{', '.join(bases)}, or <strategy>@<schedule> with schedule "
            f"{', '.join(SCHEDULES)} (e.g. lars@adaptive)")


def check_name(name: str, bases: tuple[str, ...]) -> bool:
    """Whether `name` is a base strategy or `<base>@<schedule>`."""
    base, schedule = split_name(name)
    return base in bases and (schedule is None or schedule in SCHEDULES)


def dir_name(name: str, batch: int, seed: int) -> str:
    """The cell's directory: `lars_adaptive-b4096`, `-s1` for seeds other than 0 (so that a
    one-seed study keeps the names it always had, and adding seeds reuses seed 0's cells)."""
    return f"{name.replace('@', '_')}-b{batch}" + (f"-s{seed}" if seed else "")


def cell_overrides(overrides: dict[str, list[str]], name: str) -> list[str]:
    """`[set]` items of a cell, in order: `all`, its base strategy, then its own name (a
    growing LARS is the LARS recipe with a schedule, and compares with it as such)."""
    base, schedule = split_name(name)
    own = overrides.get(name, []) if schedule else []
    return [*overrides.get("all", []), *overrides.get(base, []), *own]


def _start_override(name: str, items: list[str]) -> tuple[int | None, list[str]]:
    """The last `batch.start_batch_size=N` of `items` and the items without it."""
    from bigbatch.config.fields import parse_literal

    start, rest = None, []
    for item in items:
        key, eq, raw = item.partition("=")
        if key.strip() != START_KEY or not eq:
            rest.append(item)
            continue
        value = parse_literal(raw.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--set {name}:{START_KEY}={raw.strip()}: not a batch size; "
                              "allowed: an integer >= 1")
        start = value
    return start, rest


def scheduled_strategy(d: dict[str, Any], name: str, ceiling: int, items: list[str],
                       workers: int = 1) -> Any:
    """The Strategy of cell (`name`, `ceiling`) from the base strategy's dict `d` (as
    `bigbatch.study.rules` builds it for a fixed batch at `ceiling`) and its `[set]` items.

    Raises `NoGrowth` when the start is not below the ceiling, ConfigError (naming the
    strategy) when the schedule cannot go with the base strategy (e.g. AdaScale under a
    growing batch: both decide what a step does)."""
    from bigbatch.config.strategy import Strategy

    schedule = split_name(name)[1]
    start, rest = _start_override(name, items)
    try:
        if start is None:  # the recipe's batch, as the user's keys leave it
            start = Strategy.from_dict(d).with_overrides(rest).batch.base_batch_size
        if start >= ceiling:
            raise NoGrowth(f"{name} at batch {ceiling}: its start batch {start} is not below "
                           "it; a growing batch needs a ceiling above its start")
        d = copy.deepcopy(d)
        b, a = d["batch"], d["adaptive"]
        if schedule in ("adaptive", "seesaw"):
            b.update(schedule=schedule, start_batch_size=start)
        else:  # goodput and noise_scale_doubling start at the configured batch
            b["global_batch_size"] = start
            b["micro_batch_size"] = min(b["micro_batch_size"], max(1, start // workers))
            a.update(max_batch_size=ceiling, interval_steps=DECISION_INTERVAL)
            if schedule == "goodput":
                a.update(batch_size="goodput", min_batch_size=start)
            else:
                a["policies"] = ["noise_scale_doubling"]
        return Strategy.from_dict(d).with_overrides(rest)
    except NoGrowth:
        raise
    except ConfigError as e:
        raise ConfigError(f"strategy {name} at batch {ceiling}: {e}") from None
