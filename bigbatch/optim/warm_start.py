"""Warm-starting LARS or LAMB from another optimizer's ``state_dict``.

A LAMB built over a model that AdamW trained can take AdamW's moments: LAMB keeps the
same Adam moments (``exp_avg``, ``exp_avg_sq``, ``step``), and only the update differs.
A LARS can take momentum SGD's buffer: torch's SGD runs ``b = mu b + d, w -= lr b``,
which is LARS's stored recurrence with ``local_lr = lr`` (see ``bigbatch.optim.lars``),
so the buffer carries over with the SGD group's ``lr`` as its ``local_lr``. timm's Lamb
and Lars keep the same keys and convert alike.

The hyperparameters stay those the new optimizer was built with (another optimizer's
groups lack the trust-ratio keys, and its ``weight_decay`` means something else); only
the per-parameter state is taken, matched by position as torch matches it. Any other
state is refused in one line naming what it holds and what would be taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["adopt", "from_adam", "from_sgd"]

Convert = Callable[[dict, dict], "dict | None"]


def from_adam(entry: dict, group: dict) -> dict | None:
    """LAMB's state from Adam-family moments (torch Adam/AdamW, timm Lamb), or None."""
    if "exp_avg" not in entry or "exp_avg_sq" not in entry:
        return None
    step = entry.get("step", group.get("step", 0))
    step = step.detach().to("cpu", torch.float32) if isinstance(step, torch.Tensor) \
        else torch.tensor(float(step), dtype=torch.float32)
    return {"step": step.reshape(()), "exp_avg": entry["exp_avg"],
            "exp_avg_sq": entry["exp_avg_sq"]}


def from_sgd(entry: dict, group: dict) -> dict | None:
    """LARS's state from a momentum buffer (torch SGD, timm Lars), or None."""
    buf = entry.get("momentum_buffer")
    if buf is None:
        return None
    lr = group.get("lr", 0.0)
    lr = float(lr) if not isinstance(lr, torch.Tensor) else float(lr.item())
    return {"momentum_buffer": buf, "local_lr": torch.tensor(lr, dtype=buf.dtype)}


def adopt(owner: str, own: dict, params: list[torch.Tensor], saved: dict,
          keys: tuple[str, ...], convert: Convert, accepted: str) -> dict:
    """``saved`` as is when it is ``owner``'s own kind (its groups carry
    ``always_adapt`` and its state ``keys``); else converted by ``convert`` onto ``own``
    (``owner.state_dict()``: its groups and hyperparameters; ``params`` its tensors in the
    same order), or a ValueError in one line.

    Tensors are matched by name where both sides have names (built from
    ``named_parameters()``), else by position, and a state tensor whose shape is not its
    parameter's is refused (groups ordered differently).
    """
    groups, state = saved.get("param_groups", []), saved.get("state", {})
    if all("always_adapt" in g for g in groups) and \
            all(set(keys) <= set(entry) for entry in state.values()):
        return saved
    held = sorted({k for entry in state.values() for k in entry}) or ["no state"]
    saved_ids, saved_names = _flat(groups)
    own_ids, own_names = _flat(own["param_groups"])
    if saved_names is not None and own_names is not None:
        where = dict(zip(saved_names, saved_ids, strict=True))
        missing = [n for n in own_names if n not in where]
        if missing:
            raise ValueError(f"{owner}.load_state_dict: {missing[0]} is not in the state "
                             f"dict ({len(missing)} missing); warm-start from the same "
                             "model's optimizer")
        pairs = [(where[n], o, n) for n, o in zip(own_names, own_ids, strict=True)]
    elif len(saved_ids) != len(own_ids):
        raise ValueError(f"{owner}.load_state_dict: the state dict covers {len(saved_ids)} "
                         f"tensors, this optimizer {len(own_ids)}; warm-start from the same "
                         "model's optimizer")
    else:
        pairs = [(s, o, f"parameter {i}")
                 for i, (s, o) in enumerate(zip(saved_ids, own_ids, strict=True))]
    group_of = {i: g for g in groups for i in g["params"]}
    param_of = dict(zip(own_ids, params, strict=True))
    taken: dict[Any, dict] = {}
    for s_id, o_id, name in pairs:
        if s_id not in state:
            continue
        new = convert(state[s_id], group_of[s_id])
        if new is None:
            raise ValueError(f"{owner}.load_state_dict: the state holds {', '.join(held)} "
                             f"(another optimizer's); {owner} warm-starts from {accepted} "
                             "only (build it fresh otherwise)")
        shape = tuple(param_of[o_id].shape)
        bad = [k for k, v in new.items() if isinstance(v, torch.Tensor) and v.ndim
               and tuple(v.shape) != shape]
        if bad:
            raise ValueError(f"{owner}.load_state_dict: {name}'s {bad[0]} has shape "
                             f"{tuple(new[bad[0]].shape)}, the parameter {shape}; build both "
                             "optimizers from named_parameters() to match by name")
        taken[o_id] = new
    return {"state": taken, "param_groups": own["param_groups"]}


def _flat(groups: list[dict]) -> tuple[list, list | None]:
    """(the groups' parameter ids in order, their names or None where any is missing)."""
    ids = [i for g in groups for i in g["params"]]
    names = [n for g in groups for n in (g.get("param_names") or ())]
    return ids, (names if len(names) == len(ids) and None not in names else None)
