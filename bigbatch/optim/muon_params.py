"""Which parameters Muon takes, and the AdamW step of the others.

Muon orthogonalises hidden matrices. Embeddings (a lookup: each row is updated by its
own token's gradient, not a linear map) and the output head (Jordan's and Moonlight's
recipes keep it on AdamW), norms and biases (vectors) take AdamW in the same optimizer.
A param group says which with ``use_muon``; `muon_param_groups` builds the groups from a
model by data, not by code: ``nn.Embedding`` weights and names containing one of
``adamw`` (default ``("embed", "head")``: HF's ``embed_tokens``/``lm_head``, nanoGPT's
``wte``/``wpe`` need ``("wte", "wpe", "lm_head")``) go to AdamW, the other tensors with
``ndim >= 2`` to Muon, and tensors with ``ndim <= 1`` to AdamW without weight decay.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch

from ._base import fusable
from ._norms import local
from ._params import declared_no_decay, matches_declared

__all__ = ["adamw_step", "muon_param_groups", "split_muon_groups"]

DEFAULT_ADAMW = ("embed", "head")


def _to_adamw(name: str | None, p: torch.Tensor, adamw: Sequence[str],
              embeddings: set[int]) -> bool:
    if p.ndim < 2 or id(p) in embeddings:
        return True
    return name is not None and any(s in name for s in adamw)


def muon_param_groups(model_or_params, weight_decay: float,
                      adamw: Sequence[str] = DEFAULT_ADAMW,
                      exclude: Sequence[str] | None = None, *,
                      no_weight_decay: Collection[str] | None = None) -> list[dict]:
    """Param groups for `bigbatch.optim.Muon`: Muon matrices, AdamW matrices, and AdamW
    tensors without weight decay (``ndim <= 1``, or names containing one of ``exclude``
    when given: Fleet's ``exclude_from_weight_decay``). ``model_or_params``: a module
    (its ``nn.Embedding`` weights go to AdamW whatever their names) or ``(name, param)``
    pairs. The names a module declares in ``no_weight_decay()`` (``no_weight_decay`` for
    pairs) take no weight decay either, as in `bigbatch.param_groups`.
    A matrix that ``exclude`` or those names hold still takes Muon, without weight decay. Each
    group carries ``use_muon``, ``weight_decay``, ``param_names`` and
    ``layer_adaptation`` (False for the undecayed, as `bigbatch.param_groups` marks them).
    Empty groups are dropped."""
    embeddings: set[int] = set()
    if isinstance(model_or_params, torch.nn.Module):
        embeddings = {id(m.weight) for m in model_or_params.modules()
                      if isinstance(m, torch.nn.Embedding)}
        named = list(model_or_params.named_parameters())
        if no_weight_decay is None:
            no_weight_decay = declared_no_decay(model_or_params)
    else:
        named = list(model_or_params)
    kinds: dict[tuple[bool, bool], list] = {(True, True): [], (True, False): [],
                                            (False, True): [], (False, False): []}
    for name, p in named:
        if not p.requires_grad:
            continue
        decayed = (p.ndim >= 2 if exclude is None else not any(s in name for s in exclude)) \
            and not matches_declared(name, no_weight_decay or ())
        to_muon = not _to_adamw(name, p, adamw, embeddings)
        kinds[(to_muon, decayed)].append((name, p))
    return [{"params": [p for _, p in items], "param_names": [n for n, _ in items],
             "use_muon": to_muon, "weight_decay": weight_decay if decayed else 0.0,
             "layer_adaptation": decayed}
            for (to_muon, decayed), items in kinds.items() if items]


def split_muon_groups(params: Iterable, adamw: Sequence[str]) -> list[dict]:
    """An optimizer's ``params`` argument as groups that each carry ``use_muon``: given
    groups keep theirs; the rest are split by `muon_param_groups`'s rule (by name when
    names are given, else by ``ndim``)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("Muon: params should be an iterable of tensors or groups, "
                        "got a single tensor")
    items = list(params)
    if not items:
        raise ValueError("Muon: got an empty parameter list")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    out = []
    for group in groups:
        entries = list(group["params"]) if not isinstance(group["params"], torch.Tensor) \
            else [group["params"]]
        if entries and isinstance(entries[0], tuple):
            names: list | None = [n for n, _ in entries]
            tensors = [p for _, p in entries]
        else:
            names, tensors = group.get("param_names"), entries
        base = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if not tensors:  # ZeroRedundancyOptimizer hands a rank empty shares of some groups;
            # its groups and the local optimizer's must stay one to one.
            out.append({**base, "params": [], "use_muon": bool(base.get("use_muon", False))})
            continue
        if "use_muon" in base:
            parts = [(bool(base.pop("use_muon")), list(range(len(tensors))))]
        else:
            flags = [not _to_adamw(None if names is None else names[i], p, adamw, set())
                     for i, p in enumerate(tensors)]
            parts = [(True, [i for i, f in enumerate(flags) if f]),
                     (False, [i for i, f in enumerate(flags) if not f])]
        for to_muon, idx in parts:
            if not idx:
                continue
            if to_muon and (bad := [tensors[i] for i in idx if tensors[i].ndim < 2]):
                raise ValueError(f"Muon: a use_muon group holds a tensor of shape "
                                 f"{tuple(bad[0].shape)}; Muon takes matrices (ndim >= 2)")
            g = {**base, "params": [tensors[i] for i in idx], "use_muon": to_muon}
            if names is not None:
                g["param_names"] = [names[i] for i in idx]
            out.append(g)
    return out


def adamw_step(group: dict, params: list[torch.Tensor],
               states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               fused: bool = True, found_inf: torch.Tensor | None = None) -> None:
    """AdamW (Loshchilov & Hutter 2019; torch's ``AdamW`` rule) on the local tensors::

        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
        w = w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)

    ``fused``: torch's fused kernel where the layouts allow (float CPU / CUDA tensors
    of one kind at a time); elementwise, so sharded parameters step their shards.
    ``found_inf``: a 0-d overflow flag (GradScaler's): nonzero changes nothing, the step
    count included; read on the device only (the fused kernel's own argument, else a
    `torch.where` choice; there the bias corrections are taken on the device too)."""
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    ws, gs = [local(w) for w in params], [local(w.grad) for w in params]
    plain = []
    kinds: dict = {}
    for i, (w, g, (_, m, v)) in enumerate(zip(ws, gs, states, strict=True)):
        # meta: `bigbatch plan`'s step, which only needs the state's shapes.
        ok = (fused and not isinstance(lr, torch.Tensor)
              and w.device.type in ("cpu", "cuda", "meta")
              and w.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
              and fusable(w, g, m, v))
        (kinds.setdefault((w.device, w.dtype), []) if ok else plain).append(i)
    for idx in kinds.values():
        steps = [states[i][0] for i in idx]
        flag = None if found_inf is None else found_inf.to(steps[0].device, torch.float32)
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_([ws[i] for i in idx], [gs[i] for i in idx],
                            [states[i][1] for i in idx], [states[i][2] for i in idx], [],
                            steps, lr=float(lr), beta1=beta1, beta2=beta2,
                            weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
                            found_inf=flag)
        if flag is not None:  # as torch's AdamW: a skipped step does not count
            torch._foreach_sub_(steps, [flag] * len(steps))
    if found_inf is not None:
        for i in plain:
            _adamw_flagged(ws[i], gs[i], states[i], lr, wd, eps, beta1, beta2, found_inf)
        return
    for i in plain:
        step, m, v = states[i]
        if step.device.type != "cpu":  # bias corrections on the device: no host read
            _adamw_flagged(ws[i], gs[i], states[i], lr, wd, eps, beta1, beta2, None)
            continue
        step += 1
        t = float(step)
        w, g = ws[i], gs[i]
        w.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t)) if not isinstance(lr, torch.Tensor) \
            else w.sub_(lr / (1 - beta1 ** t) * m / denom)


def _adamw_flagged(w: torch.Tensor, g: torch.Tensor,
                   state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], lr, wd: float,
                   eps: float, beta1: float, beta2: float,
                   found_inf: torch.Tensor | None) -> None:
    """`adamw_step`'s per-tensor rule with no host read: the step count and bias
    corrections stay device tensors. Under an overflow flag the new values are kept
    where the flag is zero; with none (``found_inf=None``) they are always kept."""
    step, m, v = state
    skip = None if found_inf is None else found_inf.to(w.device).reshape(()).bool()
    step.add_(1 if skip is None else (~skip).to(step.dtype))
    t = step.to(torch.float64 if w.dtype == torch.float64 else torch.float32)
    new_m = m.lerp(g, 1 - beta1)
    new_v = (v * beta2).addcmul_(g, g, value=1 - beta2)
    denom = (new_v.sqrt() / (1 - beta2 ** t).sqrt()).add_(eps)
    new_w = w * (1 - lr * wd) - lr / (1 - beta1 ** t) * new_m / denom
    for old, new in ((m, new_m), (v, new_v), (w, new_w)):
        old.copy_(new if skip is None else torch.where(skip, old, new))
