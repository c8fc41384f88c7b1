"""MNIST-1D: procedurally generated 1-D digit signals (Greydanus, 2020), a 1-D CNN and an MLP.

The data come from the `mnist1d` package's generator (`make_dataset`), never its
download; they are generated once per parameter set and cached as a `.pt` file.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from bigbatch.config.limits import SEED_RULE
from bigbatch.errors import ConfigError
from bigbatch.parallel.pipeline import Layer, module_layer
from bigbatch.tasks._base import (
    Recipe,
    Reduce,
    Task,
    cache_file,
    check_cache_dir,
    eval_sums,
    load_cached,
    save_cached,
)

log = logging.getLogger("bigbatch.tasks")

SEQ_LEN = 40
NUM_CLASSES = 10

# Small-batch baselines, measured with `bigbatch train` (momentum SGD, cosine decay, no
# warmup, 50,000 samples, seed 0) on a 2-core CPU.
_RECIPES = {
    "cnn": Recipe(
        base_batch_size=128,
        base_lr=0.1,
        epochs=16,
        weight_decay=5e-4,
        reference=0.9931,
        reference_note="momentum SGD, batch 128, lr 0.1, 16 epochs: 72 s on 2 CPU threads "
        "(LARS demo at 4096, Nesterov: 99.16%; SGD at 4096, lr 3.2 with warmup: 69.8%)",
    ),
    "mlp": Recipe(
        base_batch_size=128,
        base_lr=0.1,
        epochs=16,
        weight_decay=5e-4,
        reference=0.9250,
        reference_note="momentum SGD, batch 128, lr 0.1, 16 epochs: 10 s on 1 CPU thread "
        "(lr 0.05: 88.9%; LARS demo at 4096: 81.8%; SGD at 4096, lr 3.2: 15%)",
    ),
}


DEMO_STRATEGY = """\
# bigbatch train's default: LARS at global batch 4096, 32x the momentum-SGD
# recipe (batch 128, lr 0.1), linear LR scaling with gradual warmup. With only
# 9 steps an epoch, the trust coefficient is 10x Fleet's default 0.001: the
# per-step relative update lr x lars_coeff peaks at 3.2%. Momentum SGD with the
# same scaling and warmup reaches about 70% here in 16 epochs (batch 128: 99.3%).
[batch]
global_batch_size = 4096
base_batch_size = 128
base_lr = 0.1
scaling = "linear"
warmup_epochs = 2
decay = "cosine"

[optimizer]
type = "momentum"
momentum = 0.9
weight_decay = 0.0

[lars]
lars_coeff = 0.01
lars_weight_decay = 0.0005
exclude_from_weight_decay = ["bn", "bias"]
"""


def cache_key(num_samples: int = 50_000, seed: int = 42) -> dict:
    """What identifies a generated data set: generator version, sample count and seed.

    The generator's other arguments are the package defaults of that version, so the
    version stands for them (and importing `mnist1d` costs about a second).
    """
    return {
        "generator": "mnist1d.data.make_dataset",
        "version": importlib.metadata.version("mnist1d"),
        "num_samples": int(num_samples),
        "seed": int(seed),
    }


def generation_args(num_samples: int = 50_000, seed: int = 42) -> dict:
    """The `mnist1d` generator arguments used: package defaults with our sample count and seed."""
    from mnist1d.data import get_dataset_args

    args = get_dataset_args(as_dict=True)
    args.pop("url", None)  # never used: we generate, we do not download
    args["num_samples"] = int(num_samples)
    args["seed"] = int(seed)
    return args


def _generate(params: dict) -> dict[str, torch.Tensor]:
    from mnist1d.data import make_dataset
    from mnist1d.utils import ObjectView

    # make_dataset reseeds the global numpy/python RNGs; keep the caller's streams intact.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(ObjectView(dict(params)))
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return {
        "x_train": torch.from_numpy(data["x"]).float(),
        "y_train": torch.from_numpy(data["y"]).long(),
        "x_test": torch.from_numpy(data["x_test"]).float(),
        "y_test": torch.from_numpy(data["y_test"]).long(),
    }


def load_data(
    num_samples: int = 50_000, seed: int = 42, cache: str | os.PathLike | None = None
) -> tuple[dict[str, torch.Tensor], Path, bool]:
    """`(tensors, cache_path, generated)`: loads the cached data set or generates and caches it."""
    if num_samples < 10:
        raise ConfigError(f"num_samples={num_samples} is too small; allowed: >= 10")
    key = cache_key(num_samples, seed)
    path = cache_file("mnist1d", key, cache)
    blob = load_cached(path, key)
    if blob is not None:
        return blob["tensors"], path, False
    check_cache_dir(path.parent)
    log.info("generating MNIST-1D (%d samples, seed %d) once; cache: %s", num_samples, seed, path)
    t0 = time.perf_counter()
    args = generation_args(num_samples, seed)
    tensors = _generate(args)
    seconds = time.perf_counter() - t0
    save_cached({"key": key, "args": args, "tensors": tensors, "seconds": seconds}, path)
    return tensors, path, True


class ConvNet(nn.Module):
    """1-D CNN with BatchNorm: three conv blocks (32-64-64 channels), global pooling, linear head."""

    def __init__(self, width: int = 32, num_classes: int = NUM_CLASSES):
        super().__init__()
        w2 = 2 * width
        self.conv1 = nn.Conv1d(1, width, 5, padding=2, bias=False)
        self.bn1 = nn.BatchNorm1d(width)
        self.conv2 = nn.Conv1d(width, w2, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm1d(w2)
        self.conv3 = nn.Conv1d(w2, w2, 3, stride=2, padding=1, bias=False)
        self.bn3 = nn.BatchNorm1d(w2)
        # Flattening keeps position (where a digit's strokes are matters in MNIST-1D).
        self.fc = nn.Linear(w2 * (SEQ_LEN // 4), num_classes)

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Conv block `i` (1-3): convolution, BatchNorm, ReLU."""
        if i == 1:
            x = x.unsqueeze(1)
        return F.relu(getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(x)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in (1, 2, 3):
            x = self.block(i, x)
        return self.head(x)

    def pipeline_layers(self) -> list[Layer]:
        """The chain a pipeline splits: the three conv blocks, then the linear head."""
        blocks = [Layer(f"conv{i}", (f"conv{i}", f"bn{i}"),
                        functools.partial(_conv_block, i)) for i in (1, 2, 3)]
        return [*blocks, Layer("fc", ("fc",), ConvNet.head)]


class MLP(nn.Module):
    """Two hidden ReLU layers, no normalisation layers."""

    def __init__(self, hidden: int = 256, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(SEQ_LEN, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    def pipeline_layers(self) -> list[Layer]:
        """The chain a pipeline splits: two hidden layers (with their ReLU), the output."""
        return [Layer("fc1", ("fc1",), functools.partial(_hidden, "fc1")),
                Layer("fc2", ("fc2",), functools.partial(_hidden, "fc2")), module_layer("fc3")]


def _conv_block(i: int, model: ConvNet, x: torch.Tensor) -> torch.Tensor:
    return model.block(i, x)


def _hidden(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.relu(model.get_submodule(name)(x))


class MNIST1D(Task):
    """10-way classification of length-40 signals; 80/20 train/test split of `num_samples`."""

    name = "mnist1d"
    models = ("cnn", "mlp")
    default_model = "cnn"
    metric = "accuracy"
    higher_is_better = True
    demo_strategy = DEMO_STRATEGY
    option_rules = {"num_samples": {"ge": 10, "le": 10_000_000}, "seed": SEED_RULE,
                    "label_smoothing": {"ge": 0, "lt": 1}}

    def __init__(
        self,
        num_samples: int = 50_000,
        seed: int = 42,
        cache_dir: str | os.PathLike | None = None,
        label_smoothing: float = 0.0,
    ):
        """`num_samples` and `seed` are the generator's; `cache_dir` overrides the cache
        location. `label_smoothing`: the training loss's (Szegedy et al. 2016, as in
        torch's cross_entropy; 0.1 in most large-batch ImageNet recipes); the test loss is
        always the plain cross-entropy. Default 0: 0.1 did worse for LARS at 8192 here
        (one seed, docs/lr-find-study.md)."""
        self.label_smoothing = float(label_smoothing)
        tensors, self.cache_path, self.generated = load_data(num_samples, seed, cache_dir)
        self.train_set = TensorDataset(tensors["x_train"], tensors["y_train"])
        self.test_set = TensorDataset(tensors["x_test"], tensors["y_test"])

    def build_model(self, name: str | None = None) -> nn.Module:
        return ConvNet() if self.check_model(name) == "cnn" else MLP()

    def recipe(self, model: str | None = None) -> Recipe:
        return _RECIPES[self.check_model(model)]

    def loss(self, output, batch):
        y = batch[1]
        # Evaluation runs without grad (`eval_sums`): its loss stays unsmoothed.
        smoothing = self.label_smoothing if torch.is_grad_enabled() else 0.0
        return F.cross_entropy(output, y, reduction="sum", label_smoothing=smoothing), y.numel()

    def evaluate(self, model, loader, reduce: Reduce | None = None) -> dict[str, float]:
        def correct(out, batch):
            return (out.argmax(-1) == batch[1]).sum()

        sums = eval_sums(self, model, loader, correct)
        if reduce is not None:
            sums = reduce(sums)
        n = max(sums[1].item(), 1.0)
        return {"loss": sums[0].item() / n, "accuracy": sums[2].item() / n}
