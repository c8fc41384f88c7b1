"""`TrainConfig`: what `bigbatch train` trains and where it writes (the Strategy says how)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from bigbatch.config.fields import check_value
from bigbatch.config.limits import COUNT_RULE, MAX_EPOCHS, SEED_RULE
from bigbatch.engine.nonfinite import MAX_NONFINITE_SKIPS, NAN_POLICIES
from bigbatch.errors import ConfigError

__all__ = ["MAX_NONFINITE_SKIPS", "TrainConfig"]

_RULES = {"epochs": {"gt": 0, "le": MAX_EPOCHS}, "steps": COUNT_RULE, "seed": SEED_RULE,
          "checkpoint_every": COUNT_RULE, "keep_checkpoints": COUNT_RULE,
          "log_every": COUNT_RULE, "eval_every": COUNT_RULE, "eval_batch_size": COUNT_RULE}


@dataclass
class TrainConfig:
    """What to train and where to write it (the Strategy says how)."""

    task: str = "mnist1d"
    """Built-in task name (see `bigbatch.tasks.TASKS`)."""
    model: str | None = None
    """Model of the task; None: the task's default."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the task (e.g. `num_samples` for mnist1d, `seq_len` for charlm)."""
    epochs: float | None = None
    """Training length in epochs; None with `steps` None: the task recipe's epochs."""
    steps: int | None = None
    """Training length in optimizer steps of the configured global batch, instead of epochs
    (with AdaScale: steps of `batch.base_batch_size`). These are the schedule's units: a
    resume whose global batch moved keeps counting steps of the first run's batch."""
    seed: int = 0
    """Seeds model init, the data order and every worker's RNGs."""
    out: str = "runs/train"
    """Output directory (rank 0 writes; must be shared storage across nodes to resume)."""
    resume: bool = False
    """Continue from the latest checkpoint in `out` (settings as `bigbatch.train.resume`
    allows)."""
    overwrite: bool = False
    """A fresh run into an `out` that holds a run: delete that run's files (only those
    bigbatch wrote) instead of refusing."""
    checkpoint_every: int | None = None
    """Optimizer steps between checkpoints; None: one per epoch. Always one at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    log_every: int | None = None
    """Optimizer steps between metrics lines; None: about ten per epoch."""
    eval_every: int | None = None
    """Optimizer steps between test evaluations; None: at each epoch's end (and the run's)."""
    progress: bool = True
    """Show the progress bar (rank 0)."""
    tensorboard: bool | None = None
    """Write TensorBoard event files; None: when tensorboard is importable."""
    eval_batch_size: int = 1024
    """Per-worker batch size of evaluation."""
    fit_warmup: bool = False
    """The strategy's warmup is a default (the task demo's), not the user's: in a run
    shorter than the task recipe's it is scaled to the run (`bigbatch.train.plan.fit_warmup`)
    instead of refused. `bigbatch train` sets it when neither the config file nor `--set`
    names `batch.warmup_steps` / `batch.warmup_epochs`."""
    nan_policy: str = "stop"
    """A non-finite loss without an fp16 loss scaler: `stop` ends the run with an error
    naming the step (`NonFiniteLossError`, exit 1), keeping the last good checkpoint; `skip`
    skips that optimizer step (counted as `nonfinite_skipped_steps`) and stops after
    `MAX_NONFINITE_SKIPS` consecutive ones."""
    trust_checkpoint: bool = False
    """On resume, accept a checkpoint that has no manifest (`--trust-checkpoint`): a save
    cut short, or files copied without their ``.json``. Its payload is still read as
    tensors and plain data only; a manifest that does not match is never accepted."""

    fleet: str | None = None
    """The Fleet strategy file the Strategy was translated from (`--fleet`): the run's
    header shows the translation (`bigbatch.config.fleet`)."""

    def __post_init__(self) -> None:
        if self.epochs is not None and self.steps is not None:
            raise ConfigError("give --epochs or --steps, not both")
        if self.resume and self.overwrite:
            raise ConfigError("give --resume or --overwrite, not both")
        hints = typing.get_type_hints(TrainConfig)
        for f in dataclasses.fields(self):
            rules = _RULES.get(f.name, {})
            value = getattr(self, f.name)
            if f.name == "nan_policy" and value not in NAN_POLICIES:
                raise ConfigError(f"nan_policy={value!r} is not valid; allowed: "
                                  f"{', '.join(NAN_POLICIES)}")
            setattr(self, f.name, check_value(f.name, value, hints[f.name], rules))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
