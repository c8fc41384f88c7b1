"""The study's strategies: how each one scales the task's small-batch recipe to a batch.

`cell_strategy` turns (recipe, strategy name, global batch) into the Strategy of one cell;
`RULES` says the same in one line each for the report. The sweep (`bigbatch.study.sweep`) applies them.
A name `"<base>@<schedule>"` is the base strategy with a growing batch whose ceiling is the
cell's batch (`bigbatch.study.schedules`).
"""

from __future__ import annotations

from typing import Any, Protocol

from bigbatch.errors import ConfigError


class Grid(Protocol):
    """What the rules read of a `StudyConfig` (which imports `STRATEGIES` from here)."""

    epochs: float | None
    warmup_epochs: float | None
    micro_batch_size: int
    nproc: int
    overrides: dict[str, list[str]]
    lr_find: bool
    lr_find_above_base: bool


STRATEGIES = ("sgd", "lars", "lamb", "adascale", "kfac", "muon")
RULES = {
    "sgd": "the recipe's optimizer, linear LR scaling + gradual warmup (Goyal et al. 2017)",
    "lars": "LARS on momentum SGD, linear LR scaling + warmup (You et al. 2017)",
    "lamb": "LAMB on AdamW, square-root LR scaling + warmup (You et al. 2020)",
    "adascale": "the recipe's optimizer, AdaScale LR gain, no scaling rule (Johnson et al. 2020)",
    "kfac": "K-FAC preconditioning on momentum SGD, linear LR scaling + warmup (Osawa et al. 2019)",
    "muon": "Muon on hidden matrices + AdamW on the rest at AdamW's LR (update RMS matched, "
            "Liu et al. 2025), square-root LR scaling + warmup (Jordan et al. 2024)",
}
LAYERWISE_EXCLUDE = ["bn", "norm", "bias"]
#: LR of LARS / LAMB when the recipe's optimizer is the other family (their per-step
#: relative update is about lr x lars_coeff x 1/(1-momentum), resp. lr).
LARS_DEFAULT = {"lars_coeff": 0.01, "base_lr": 0.1}
LAMB_DEFAULT = {"base_lr": 0.01, "weight_decay": 0.01}
#: LR and weight decay of Muon + AdamW when the recipe is momentum SGD: torch's AdamW
#: defaults, which `[muon]`'s update-RMS rule makes Muon's too (an AdamW recipe's carry over).
MUON_DEFAULT = {"base_lr": 1e-3, "weight_decay": 0.01}


def _warmup_epochs(c: Grid, recipe: Any) -> float:
    if c.warmup_epochs is not None:
        return c.warmup_epochs
    epochs = c.epochs or recipe.epochs
    # The recipe's warmup keeps its share of a budget shorter than the recipe's (as
    # `bigbatch train --steps` does), so that a short study's warmup fits its cells.
    return max(recipe.warmup_epochs * min(1.0, epochs / recipe.epochs), epochs / 8)


def rule(name: str) -> str:
    """The report's line for a strategy name, a growing one included."""
    from bigbatch.study.schedules import SCHEDULES, split_name

    base, schedule = split_name(name)
    if schedule is None:
        return RULES[base]
    return (f"{base} ({RULES[base]}) with a growing batch up to the cell's batch: "
            f"{SCHEDULES[schedule]}")


def cell_strategy(c: Grid, recipe: Any, name: str, batch: int) -> Any:
    """The Strategy of cell (`name`, `batch`): the recipe scaled by the strategy's rule;
    for `"<base>@<schedule>"`, the base's at `batch` as the ceiling, growing from its start
    (`bigbatch.study.schedules.scheduled_strategy`, which raises `NoGrowth` when the start
    is not below `batch`)."""
    from bigbatch.config.strategy import Strategy
    from bigbatch.study.schedules import cell_overrides, scheduled_strategy, split_name

    full, (name, schedule) = name, split_name(name)

    micro = min(c.micro_batch_size, max(1, batch // c.nproc))
    if batch % (micro * c.nproc):
        raise ConfigError(f"--batches: {batch} is not a multiple of micro batch {micro} x "
                          f"nproc {c.nproc}; use multiples of {micro * c.nproc}")
    momentum_recipe = recipe.optimizer == "momentum"
    b = {"global_batch_size": batch, "micro_batch_size": micro,
         "base_batch_size": recipe.base_batch_size, "base_lr": recipe.base_lr,
         "scaling": "linear", "warmup_epochs": _warmup_epochs(c, recipe), "decay": recipe.decay}
    opt: dict[str, Any] = {"type": recipe.optimizer, "weight_decay": recipe.weight_decay}
    if momentum_recipe:
        opt["momentum"] = recipe.momentum
    else:
        opt.update(beta1=recipe.momentum, epsilon=1e-6)
    if getattr(c, "lr_find", False) and (batch > recipe.base_batch_size
                                         or not getattr(c, "lr_find_above_base", False)):
        b["lr_find"] = True
    d: dict[str, Any] = {"batch": b, "optimizer": opt, "gradient_merge": {"avg": True},
                         "adaptive": {"noise_scale": True}}
    if name == "lars":
        if not momentum_recipe:
            b["base_lr"] = LARS_DEFAULT["base_lr"]
        d["optimizer"] = {"type": "momentum", "momentum": 0.9, "weight_decay": 0.0}
        d["lars"] = {"lars_coeff": LARS_DEFAULT["lars_coeff"],
                     "lars_weight_decay": recipe.weight_decay if momentum_recipe else 5e-4,
                     "exclude_from_weight_decay": LAYERWISE_EXCLUDE}
    elif name == "lamb":
        b["scaling"] = "sqrt"
        if momentum_recipe:
            b["base_lr"] = LAMB_DEFAULT["base_lr"]
        d["optimizer"] = {"type": "adamw", "beta1": 0.9, "epsilon": 1e-6, "weight_decay": 0.0}
        d["lamb"] = {"lamb_weight_decay": LAMB_DEFAULT["weight_decay"] if momentum_recipe
                     else recipe.weight_decay, "exclude_from_weight_decay": LAYERWISE_EXCLUDE}
    elif name == "adascale":
        b.update(scaling="none", warmup_epochs=recipe.warmup_epochs)
        d["adaptive"]["lr"] = "adascale"
    elif name == "kfac":  # [kfac]'s defaults; an Adam-type recipe gets momentum SGD's LR
        if not momentum_recipe:
            b["base_lr"] = LARS_DEFAULT["base_lr"]
            d["optimizer"] = {"type": "momentum", "momentum": 0.9, "weight_decay": 5e-4}
        d["kfac"] = {}
    elif name == "muon":
        # Muon's update has a fixed RMS (as Adam's sign-like step), so its LR follows the
        # square-root rule as LAMB's; [muon] carries the weight decay (compat: not twice).
        b["scaling"] = "sqrt"
        if momentum_recipe:
            b["base_lr"] = MUON_DEFAULT["base_lr"]
        d["optimizer"] = {"type": "adamw", "beta1": 0.9, "epsilon": 1e-6, "weight_decay": 0.0}
        d["muon"] = {"muon_weight_decay": MUON_DEFAULT["weight_decay"] if momentum_recipe
                     else recipe.weight_decay}
    items = cell_overrides(c.overrides, full)
    if schedule is not None:
        return scheduled_strategy(d, full, batch, items, c.nproc)
    return Strategy.from_dict(d).with_overrides(items)
