"""What a batch-size study sweeps (`StudyConfig`), and the `--quick` grids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.study.rules import STRATEGIES

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
    batches: list[int] | None = None
    """Global batch sizes; None: the recipe's base batch x 1, 4, 16, 64."""
    strategies: list[str] | None = None
    """Strategy names from `STRATEGIES`; None: sgd and the layer-wise one for the recipe."""
    epochs: float | None = None
    """Epoch budget of every cell; None: the recipe's."""
    target: float | None = None
    """Test-metric target for steps-to-target; None: the baseline's final value -/+ 1 point."""
    tolerance: float | None = None
    """Allowed loss vs the baseline for "keeps accuracy"; None: 0.005 (accuracy) / 0.02 (bpc)."""
    micro_batch_size: int = 128
    """Per-worker micro-batch (gradient merge above it); also the noise scale's small batch."""
    warmup_epochs: float | None = None
    """Warmup of the scaled strategies; None: max(recipe's, epochs / 8)."""
    evals_per_epoch: int = 4
    """Test evaluations per epoch (steps-to-target are interpolated between them)."""
    overrides: dict[str, list[str]] = field(default_factory=dict)
    """Strategy name (or "all") -> `section.key=value` overrides of its cells."""
    seed: int = 0
    """Seed of every cell (same init and data order)."""
    nproc: int = 1
    """Workers per cell; > 1 launches `bigbatch train` through torchrun."""
    threads: int | None = None
    """torch threads per worker (OMP_NUM_THREADS); None: torch's default. On a shared CPU
    use 1: oversubscribed OpenMP threads spin, and small models gain little from more."""
    out: str = "runs/study"
    """Output directory."""
    progress: bool = True
    """Show a live progress bar on a terminal (else one line per cell)."""

    def __post_init__(self) -> None:
        if self.batches is not None:
            if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
                raise ConfigError(f"batches={self.batches} must be integers >= 1")
            self.batches = sorted(set(self.batches))
        if self.strategies is not None:
            bad = [s for s in self.strategies if s not in STRATEGIES]
            if bad or not self.strategies:
                raise ConfigError(f"strategies={bad or '[]'}: unknown; valid: {', '.join(STRATEGIES)}")
            self.strategies = list(dict.fromkeys(self.strategies))
        for name, low in (("micro_batch_size", 1), ("evals_per_epoch", 1), ("nproc", 1),
                          ("threads", 1)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ConfigError(f"{name}={getattr(self, name)} is out of range; allowed: >= {low}")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"epochs={self.epochs} is out of range; allowed: > 0")
        for key in self.overrides:
            if key != "all" and key not in STRATEGIES:
                raise ConfigError(f"--set {key}:...: unknown strategy; valid: all, {', '.join(STRATEGIES)}")


