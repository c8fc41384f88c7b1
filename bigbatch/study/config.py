"""What a batch-size study sweeps (`StudyConfig`), and the `--quick` grids."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from bigbatch.config.fields import check_fields
from bigbatch.config.limits import COUNT_RULE, MAX_EPOCHS, SEED_RULE
from bigbatch.errors import ConfigError
from bigbatch.study.rules import STRATEGIES
from bigbatch.study.schedules import check_name, valid_forms

__all__ = ["QUICK", "StudyConfig"]

QUICK = {  # per task: a grid that finishes in a few minutes on 2 CPU cores
    "mnist1d": {"model": "cnn", "task_options": {"num_samples": 20000}, "epochs": 12,
                "batches": [128, 512, 2048, 4096], "strategies": ["sgd", "lars"], "threads": 1},
    "charlm": {"task_options": {"d_model": 64, "n_layer": 1, "seq_len": 32}, "epochs": 2,
               "batches": [16, 64, 256, 1024], "strategies": ["sgd", "lamb"], "threads": 1},
}


@dataclass
class StudyConfig:
    """One batch-size study: the grid, the budget and where to write."""

    task: str = "mnist1d"
    """Built-in task."""
    model: str | None = None
    """Model of the task; None: its default."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Task constructor options (e.g. `num_samples`)."""
    batches: list[int] | None = field(default=None, metadata=COUNT_RULE)
    """Global batch sizes (a growing strategy's largest); None: the recipe's base batch x 1,
    4, 16, 64."""
    strategies: list[str] | None = None
    """Strategy names from `STRATEGIES`, or `"<strategy>@<schedule>"` (schedule adaptive,
    seesaw, goodput or doubling: a batch that grows from the recipe's up to the cell's
    batch, `bigbatch.study.schedules`); None: sgd and the layer-wise one for the recipe."""
    epochs: float | None = field(default=None, metadata={"gt": 0, "le": MAX_EPOCHS})
    """Epoch budget of every cell; None: the recipe's."""
    target: float | None = None
    """Test-metric target for steps-to-target; None: the baseline's final value -/+ 1 point."""
    tolerance: float | None = field(default=None, metadata={"ge": 0})
    """Allowed loss vs the baseline for "keeps accuracy"; None: 0.005 (accuracy) / 0.02 (bpc)."""
    micro_batch_size: int = field(default=128, metadata=COUNT_RULE)
    """Per-worker micro-batch (gradient merge above it); also the noise scale's small batch."""
    warmup_epochs: float | None = field(default=None, metadata={"ge": 0, "le": MAX_EPOCHS})
    """Warmup of the scaled strategies; None: max(the recipe's, scaled down with a budget
    shorter than the recipe's epochs, epochs / 8)."""
    evals_per_epoch: int = field(default=4, metadata={"ge": 1, "le": 10_000})
    """Test evaluations per epoch (steps-to-target are interpolated between them)."""
    overrides: dict[str, list[str]] = field(default_factory=dict)
    """Strategy name (or "all") -> `section.key=value` overrides of its cells. A base name's
    apply to its growing forms too ("lars" to "lars@seesaw"), before their own."""
    lr_find: bool = False
    """Every cell runs the LR range test at its batch before training and trains at the
    peak LR it finds (`[batch] lr_find = true`), instead of the recipe's LR scaled by the
    strategy's rule; the found LR is in each cell's summary.json."""
    lr_find_above_base: bool = False
    """With `lr_find`: only cells whose batch is above the recipe's run the range test; at
    the recipe's batch each strategy keeps its rule's LR (the recipe's own for the
    baseline: a range test of a few small-batch steps is noisy there)."""
    seed: int = field(default=0, metadata=SEED_RULE)
    """Seed of every cell (same init and data order) when `seeds` is unset."""
    seeds: list[int] | None = field(default=None, metadata=SEED_RULE)
    """Seeds: every (strategy, batch) cell runs once per seed, and the report gives each
    number as mean +- sample std over them. None: [seed]."""
    nproc: int = field(default=1, metadata={"ge": 1, "le": 4096})
    """Workers per cell; > 1 launches `bigbatch train` through torchrun."""
    threads: int | None = field(default=None, metadata={"ge": 1, "le": 4096})
    """torch threads per worker (OMP_NUM_THREADS); None: torch's default. On a shared CPU
    use 1: oversubscribed OpenMP threads spin, and small models gain little from more."""
    out: str = "runs/study"
    """Output directory."""
    progress: bool = True
    """Show a live progress bar on a terminal (else one line per cell)."""

    def __post_init__(self) -> None:
        # Types and ranges of every key, named as in the study TOML (study.KEY).
        check_fields(self, "study", typing.get_type_hints(StudyConfig))
        if self.batches is not None:
            if not self.batches:
                raise ConfigError("study.batches is empty; give global batch sizes, e.g. "
                                  "[128, 512, 2048]")
            self.batches = sorted(set(self.batches))
        if self.strategies is not None:
            bad = [s for s in self.strategies if not check_name(s, STRATEGIES)]
            if bad or not self.strategies:
                raise ConfigError(f"strategies={bad or '[]'}: unknown; valid: "
                                  f"{valid_forms(STRATEGIES)}")
            self.strategies = list(dict.fromkeys(self.strategies))
        for key in self.overrides:
            if key != "all" and not check_name(key, STRATEGIES):
                raise ConfigError(f"--set {key}:...: unknown strategy; valid: all, "
                                  f"{valid_forms(STRATEGIES)}")
        if self.seeds is not None:
            if not self.seeds:
                raise ConfigError("study.seeds is empty; give seeds, e.g. [0, 1]")
            if self.seed and self.seed not in self.seeds:
                raise ConfigError(f"study.seed={self.seed} is not in study.seeds={self.seeds}; "
                                  "give one of them")
            self.seeds = list(dict.fromkeys(self.seeds))

    @property
    def seed_list(self) -> list[int]:
        """The seeds every cell runs with (`seeds`, else `[seed]`)."""
        return list(self.seeds) if self.seeds is not None else [self.seed]


