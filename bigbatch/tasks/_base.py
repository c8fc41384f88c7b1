"""The `Task` interface shared by the built-in tasks, and their small-batch recipes."""

from __future__ import annotations

import abc
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bigbatch.errors import ConfigError
from bigbatch.parallel.model_plan import ModelPlan

if TYPE_CHECKING:
    from bigbatch.parallel.tensor_parallel import Plan

#: Sums a tensor over all workers (e.g. an all-reduce); `None` means single process.
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Recipe:
    """A known-good small-batch recipe for one (task, model): the baseline large batches scale from."""

    base_batch_size: int
    """Global batch size of the baseline run."""
    base_lr: float
    """Learning rate at `base_batch_size`; scaling rules multiply this."""
    epochs: int
    """Epoch budget of the baseline (and of a batch-size study at the same budget)."""
    optimizer: str = "momentum"
    """`momentum` (SGD with momentum) or `adamw`: the baseline's optimizer."""
    momentum: float = 0.9
    """SGD momentum (or Adam's beta1)."""
    weight_decay: float = 5e-4
    """Weight decay of the baseline optimizer."""
    warmup_epochs: float = 0.0
    """Linear warmup of the baseline, in epochs."""
    decay: str = "cosine"
    """Learning-rate decay after warmup (as in `[batch] decay`)."""
    reference: float | None = None
    """Measured test metric of this recipe after `epochs` (None if not measured)."""
    reference_note: str = ""
    """How `reference` was measured (command, threads, time)."""


class Task(abc.ABC):
    """A built-in training task: data, models, a loss with exact counts, and evaluation.

    Batches are `(inputs, targets)` tuples of tensors; a model is called as
    `model(inputs)`, and `loss(output, batch)` returns `(loss_sum, count)` so that
    a distributed loop can normalise by the exact global number of items.
    """

    name: ClassVar[str]
    models: ClassVar[tuple[str, ...]]
    default_model: ClassVar[str]
    metric: ClassVar[str]
    """Name of the headline test metric in `evaluate`'s result."""
    higher_is_better: ClassVar[bool]
    demo_strategy: ClassVar[str]
    """Strategy TOML of `bigbatch train`'s default run on this task (a large-batch demo)."""
    option_rules: ClassVar[dict[str, dict]] = {}
    """Constructor option -> its allowed range (`ge`/`gt`/`le`/`lt`), checked with its type
    annotation before the task is built (`bigbatch.tasks.check_options`)."""

    train_set: TensorDataset
    test_set: TensorDataset
    default_options: bool = True
    """Built with default options (data and model sizes): the recipes' references apply."""

    @abc.abstractmethod
    def build_model(self, name: str | None = None) -> nn.Module:
        """A fresh model `name` (default: `default_model`); seeds come from torch's RNG."""

    @abc.abstractmethod
    def recipe(self, model: str | None = None) -> Recipe:
        """The small-batch baseline recipe for `model`."""

    @abc.abstractmethod
    def loss(self, output: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
        """`(sum of per-item losses, number of items)` for one batch."""

    @abc.abstractmethod
    def evaluate(
        self, model: nn.Module, loader: Iterable, reduce: Reduce | None = None
    ) -> dict[str, float]:
        """Metrics over `loader` (model in eval mode, no grad); `reduce` sums across workers."""

    def tp_plan(self, model: nn.Module) -> Plan | None:
        """The tensor-parallel plan of `model` (one this task built): a dict
        {module name: style} or a callable `parallelize(model, mesh) -> model`, as
        `bigbatch.parallel.tensor_parallel.apply_tensor_parallel` takes; None: no plan."""
        return None

    def model_plan(self, model: nn.Module) -> ModelPlan:
        """What `model` (one this task built) contributes to parallelism: its
        tensor-parallel plan (`tp_plan`); its blocks (FSDP2 units) are found through its
        `nn.ModuleList`s and its pipeline layers through its `pipeline_layers()`."""
        return ModelPlan(tp_plan=self.tp_plan(model))

    def data_note(self) -> str | None:
        """One line for a run's header saying which data the task holds when its options
        choose among data sets (charlm's corpus: Python version, files, hash, cache), so a
        log shows what the numbers were measured on; None: nothing to add."""
        return None

    def check_tensor_parallel(self, degree: int) -> None:
        """A ConfigError naming the option if this task's model cannot be split `degree`
        ways (call it before starting workers); the base refuses any degree above 1 when
        the task has no plan."""
        if degree > 1 and type(self).tp_plan is Task.tp_plan:
            raise ConfigError(f"tensor_parallel_degree={degree}: task {self.name!r} has no "
                              f"tensor-parallel plan; allowed: 1")

    def check_model(self, name: str | None) -> str:
        """`name` (or the default) if this task has such a model, else a ConfigError."""
        name = self.default_model if name is None else name
        if name not in self.models:
            raise ConfigError(
                f"model={name!r} is not a model of task {self.name!r}; "
                f"valid: {', '.join(self.models)}"
            )
        return name


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def eval_sums(
    task: Task, model: nn.Module, loader: Iterable, extra: Callable | None = None
) -> torch.Tensor:
    """`[loss_sum, count, extra_sum]` over `loader` in float64, model in eval mode.

    `extra(output, batch)` adds a task-specific sum (e.g. correct predictions).
    """
    device = _device_of(model)
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    try:
        for batch in loader:
            batch = tuple(t.to(device, non_blocking=True) for t in batch)
            out = model(batch[0])
            loss_sum, count = task.loss(out, batch)
            sums[0] += loss_sum.double()
            sums[1] += count
            if extra is not None:
                sums[2] += extra(out, batch)
    finally:
        model.train(was_training)
    return sums


def reduce_sums(sums: torch.Tensor, reduce: Reduce | None) -> torch.Tensor:
    return sums if reduce is None else reduce(sums)


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where generated datasets are cached: `override`, else `$XDG_CACHE_HOME/bigbatch`
    (default `~/.cache/bigbatch`)."""
    if override is not None:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bigbatch"


def params_hash(params: dict) -> str:
    """A short stable hash of JSON-able generation parameters (the cache key)."""
    blob = json.dumps(params, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_file(prefix: str, key: dict, override: str | os.PathLike | None = None) -> Path:
    """The cache file of a data set identified by `key`: `<cache_dir>/<prefix>-<hash>.pt`."""
    return cache_dir(override) / f"{prefix}-{params_hash(key)}.pt"


def load_cached(path: Path, key: dict) -> dict | None:
    """The blob cached at `path` if it was written for `key`, else None (missing, corrupt,
    foreign or stale: the caller regenerates over it). Read with `weights_only=True`, so a
    planted file can hold tensors and plain containers but never run code."""
    if not path.exists():
        return None
    try:
        blob = torch.load(path, weights_only=True)
    except Exception:  # a corrupt or foreign file
        return None
    return blob if isinstance(blob, dict) and blob.get("key") == key else None


def check_cache_dir(directory: Path) -> None:
    """Before generating: the cache directory can be made and written (one line if not),
    so a bad location fails before the work, not after it."""
    hint = "set XDG_CACHE_HOME or --task-opt cache_dir=DIR"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the data cache directory {directory}: "
                          f"{e.strerror}; {hint}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"the data cache directory {directory} is not writable; {hint}")


def save_cached(blob: dict, path: Path) -> None:
    """`blob` (holding its `key`) to `path` atomically (a temporary file, then a rename):
    a reader sees the old file or the new one, never a torn write."""
    from bigbatch.train.checkpoint import atomic_save  # lazily: `bigbatch --help` stays fast

    try:
        atomic_save(blob, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError
        raise ConfigError(f"cannot write the data cache {path}: "
                          f"{getattr(e, 'strerror', None) or str(e).splitlines()[0]}") from None
