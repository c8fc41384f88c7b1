"""Parameter handling shared by LARS and LAMB: groups, exclusion, validation.

Per-parameter policy is data: a param group carries ``weight_decay`` and
``layer_adaptation`` (whether the trust ratio applies). Excluded parameters
(Fleet's ``exclude_from_weight_decay``) land in groups with no weight decay
and, unless ``always_adapt``, no trust ratio.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Collection, Iterable, Sequence

import torch

__all__ = ["param_groups", "declared_no_decay", "matches_declared", "split_by_exclusion",
           "check_range"]


def check_range(owner: str, name: str, value, low=None, high=None, *,
                low_open=False, high_open=False) -> None:
    """Raise ValueError naming the argument, its value and the allowed range."""
    bad = value is None or (isinstance(value, float) and math.isnan(value))
    if not bad and low is not None:
        bad = value <= low if low_open else value < low
    if not bad and high is not None:
        bad = value >= high if high_open else value > high
    if bad:
        lo = "-inf" if low is None else repr(low)
        hi = "inf" if high is None else repr(high)
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{owner}: {name}={value!r} is outside the allowed range {interval}")


def _is_named(items: list) -> bool:
    return bool(items) and isinstance(items[0], tuple) and len(items[0]) == 2 \
        and isinstance(items[0][0], str)


def default_no_decay(name: str, param: torch.Tensor) -> bool:
    """The default exclusion rule: biases and normalisation weights (ndim <= 1)."""
    return param.ndim <= 1


def declared_no_decay(module: torch.nn.Module) -> set[str]:
    """The parameter names a model keeps from weight decay by timm's convention: what
    ``no_weight_decay()`` returns (ViT's ``{"pos_embed", "cls_token"}``), on the module
    and on any submodule, whose names get its path as prefix (a timm model held as
    ``self.backbone`` by a LightningModule declares ``backbone.pos_embed``). Entries may
    hold ``fnmatch`` wildcards, as timm's own matching allows."""
    names: set[str] = set()
    for path, sub in module.named_modules():
        own = getattr(sub, "no_weight_decay", None)
        if callable(own):
            names.update(f"{path}.{n}" if path else str(n) for n in own())
    return names


def matches_declared(name: str, names: Collection[str]) -> bool:
    """`name` is one of `declared_no_decay`'s names, or matches one holding a wildcard."""
    return name in names or any(fnmatch.fnmatchcase(name, n) for n in names
                                if any(c in n for c in "*?["))


def _matches(name: str, patterns: Sequence[str], match: str = "substring") -> bool:
    if match == "suffix":
        return any(name.endswith(p) for p in patterns)
    return any(p in name for p in patterns)


def param_groups(model_or_params, weight_decay: float,
                 exclude: Sequence[str] | None = None, match: str = "substring", *,
                 no_weight_decay: Collection[str] | None = None) -> list[dict]:
    """Split parameters into a decay group and a no-decay group.

    ``model_or_params`` is an ``nn.Module`` or an iterable of ``(name, param)``.
    A parameter is excluded when its name contains one of the ``exclude``
    substrings (Fleet's ``exclude_from_weight_decay``, e.g. ``("bn", "bias")``), or
    ends with one when ``match="suffix"`` (Fleet's lamb); with ``exclude=None`` the default rule applies: every tensor with
    ``ndim <= 1`` (biases and normalisation weights) is excluded. The names a module
    declares in ``no_weight_decay()`` (timm's ViT: ``pos_embed``, ``cls_token``; see
    `declared_no_decay`) are excluded too, under either rule; ``no_weight_decay`` gives
    those names when the parameters come as ``(name, param)`` pairs (default: the
    module's declared names, none for pairs).

    Excluded parameters get ``weight_decay=0`` and ``layer_adaptation=False``
    (no trust ratio in LARS / LAMB, so they take a plain momentum or Adam step,
    unless the optimizer has ``always_adapt=True``). Plain torch optimizers ignore the
    ``layer_adaptation`` and ``param_names`` keys, so the same groups serve an
    AdamW or SGD baseline. Empty groups are dropped.
    """
    if match not in ("substring", "suffix"):
        raise ValueError(f"param_groups: match={match!r} should be 'substring' or 'suffix'")
    named = list(model_or_params.named_parameters()) if isinstance(
        model_or_params, torch.nn.Module) else list(model_or_params)
    if no_weight_decay is None:
        no_weight_decay = declared_no_decay(model_or_params) if isinstance(
            model_or_params, torch.nn.Module) else ()
    if named and not _is_named(named):
        raise ValueError("param_groups: expected a module or (name, parameter) pairs")
    decay, no_decay = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        excluded = matches_declared(name, no_weight_decay) or (
            default_no_decay(name, p) if exclude is None else _matches(name, exclude, match))
        (no_decay if excluded else decay).append((name, p))
    groups = []
    if decay:
        groups.append({"params": [p for _, p in decay], "param_names": [n for n, _ in decay],
                       "weight_decay": weight_decay, "layer_adaptation": True})
    if no_decay:
        groups.append({"params": [p for _, p in no_decay],
                       "param_names": [n for n, _ in no_decay],
                       "weight_decay": 0.0, "layer_adaptation": False})
    return groups


def split_by_exclusion(owner: str, params: Iterable, exclude: Sequence[str]) -> list[dict]:
    """Normalise an optimizer's ``params`` argument into param groups.

    Accepts ``model.named_parameters()``, plain parameters, or group dicts
    (whose ``params`` may themselves be named). Names are kept in each group's
    ``param_names`` for logging. With ``exclude``, every group is split into
    its kept part and an excluded part (no weight decay, no trust ratio).
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{owner}: params should be an iterable of tensors or groups, "
                        "got a single tensor")
    items = list(params)
    if not items:
        raise ValueError(f"{owner}: got an empty parameter list")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    out = []
    for group in groups:
        entries = list(group["params"]) if not isinstance(group["params"], torch.Tensor) \
            else [group["params"]]
        if _is_named(entries):
            names = [n for n, _ in entries]
            tensors = [p for _, p in entries]
        else:
            names = group.get("param_names")
            tensors = entries
        if exclude and names is None:
            raise ValueError(f"{owner}: exclude={tuple(exclude)!r} needs parameter names; "
                             "pass model.named_parameters() instead of model.parameters()")
        base = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if not exclude:
            out.append({**base, "params": tensors, "param_names": names})
            continue
        kept = [(n, p) for n, p in zip(names, tensors, strict=True) if not _matches(n, exclude)]
        dropped = [(n, p) for n, p in zip(names, tensors, strict=True) if _matches(n, exclude)]
        if kept:
            out.append({**base, "params": [p for _, p in kept],
                        "param_names": [n for n, _ in kept]})
        if dropped:
            out.append({**base, "params": [p for _, p in dropped],
                        "param_names": [n for n, _ in dropped],
                        "weight_decay": 0.0, "layer_adaptation": False})
    for g in out:
        if g["param_names"] is None:
            del g["param_names"]
    return out
