"""Muon: momentum orthogonalised by a Newton-Schulz iteration (Jordan et al. 2024,
"Muon: An optimizer for hidden layers in neural networks"; the AdamW-matched update scale
and decoupled weight decay of Liu et al. 2025, "Muon is Scalable for LLM Training",
Moonlight).

Update of a hidden matrix ``W`` (m x n; a convolution's weight viewed as out x the rest)::

    B = momentum * B + G
    D = G + momentum * B          (nesterov; else D = B)
    O = NS(D)                     (Newton-Schulz: D's polar factor, approximately U V^T)
    W = W * (1 - lr * weight_decay) - lr * scale(m, n) * O

``NS`` normalises ``X = D / (||D||_F + eps)``, works on the wide orientation (``X^T``
when m > n), and repeats ``ns_steps`` times ``A = X X^T; X = a X + (b A + c A A) X``.
Defaults, and where they come from:

- ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, 5 steps, ``eps = 1e-7``: Jordan's quintic,
  chosen to push every singular value into about [0.7, 1.2] in 5 steps (Moonlight uses the
  same); momentum 0.95 with Nesterov (both recipes).
- ``scale_rule="adamw"``: ``scale = update_rms * sqrt(max(m, n))`` with ``update_rms =
  0.2`` (Moonlight): the update's RMS is then about 0.2, AdamW's typical update RMS, so
  AdamW's learning rate and weight decay carry over unchanged. ``"shape"`` is Jordan's
  ``sqrt(max(1, m / n))``; ``"none"`` is 1.

Muon takes the 2-D (and higher: convolutions) hidden weights; embeddings, the output
head, norms and biases take AdamW in the same optimizer (param groups with
``use_muon=False``; `muon_param_groups` splits a model). The momentum buffer holds the
merged gradient's history: with gradient merge the optimizer steps once per merged
gradient, so Muon orthogonalises each optimizer step's gradient once.

Sharded parameters (FSDP2 rows, tensor-parallel slices) are orthogonalised whole: the
elementwise parts run on local shards and ``NS`` on whole matrices, each on one owner
rank (`bigbatch.optim.whole_matrices`), so a split model steps as the whole one does.
Replicated ones (DDP's ranks, given as ``replicas``; a DTensor's replicated mesh
dimension) split ``NS`` between the replicas, each matrix on one of them, and all-gather
the results: no rank orthogonalises every matrix unless ``spread_ns=False``.

Kernels, behind one function ``muon(params, grads, bufs, ..., kernel=)``: ``"reference"``
(one matrix at a time, in the parameter's dtype: the spec) and ``"batched"``
(matrices of one shape stacked into one batched product per iteration; on CUDA in
``ns_dtype``, bfloat16 by default, as the reference implementations do; no host sync).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import zip_longest
from typing import Any

import torch

from ._base import EagerStepOptimizer
from ._norms import local
from ._params import check_range
from .layouts import align_group
from .muon_params import adamw_step, split_muon_groups
from .whole_matrices import apply_whole, ns_cost, split_work

__all__ = ["Muon", "muon", "newton_schulz", "update_scale", "NS_COEFFICIENTS", "NS_STEPS",
           "SCALE_RULES"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
SCALE_RULES = ("adamw", "shape", "none")
KERNELS = ("auto", "reference", "batched")


def newton_schulz(d: torch.Tensor, steps: int = NS_STEPS,
                  coefficients: Sequence[float] = NS_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Newton-Schulz quintic on the last two dims of ``d`` (a matrix or a batch of
    them), in ``dtype`` (default ``d``'s); the result in ``d``'s dtype."""
    a, b, c = coefficients
    x = d if dtype is None or d.dtype == dtype else d.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if tall:
        x = x.mT
    return x.to(d.dtype)


def update_scale(rule: str, rows: int, cols: int, update_rms: float = 0.2) -> float:
    """The factor on ``lr * O`` (module docstring): ``"adamw"``, ``"shape"`` or ``"none"``."""
    if rule == "adamw":
        return update_rms * math.sqrt(max(rows, cols))
    if rule == "shape":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "none":
        return 1.0
    raise ValueError(f"muon: scale_rule={rule!r} should be one of {SCALE_RULES}")


def _orthogonalise(kernel: str, opts: dict, ns_dtype: torch.dtype | None):
    """``fn(list of whole tensors) -> list`` for `apply_whole`: each viewed as rows x rest."""
    def fn(wholes: list[torch.Tensor]) -> list[torch.Tensor]:
        kw = dict(steps=opts["ns_steps"], coefficients=opts["ns_coefficients"],
                  eps=opts["ns_eps"])
        if kernel == "reference":
            return [newton_schulz(d.reshape(d.shape[0], -1), **kw).view(d.shape)
                    for d in wholes]
        out: list = [None] * len(wholes)
        same: dict = {}
        for i, d in enumerate(wholes):
            same.setdefault((tuple(d.shape), d.dtype, d.device), []).append(i)
        for (shape, _, device), idx in same.items():
            dtype = ns_dtype if device.type == "cuda" else None
            stacked = torch.stack([wholes[i].reshape(shape[0], -1) for i in idx])
            for i, r in zip(idx, newton_schulz(stacked, dtype=dtype, **kw).unbind(), strict=True):
                out[i] = r.view(shape)
        return out
    return fn


def muon(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
         bufs: Sequence[torch.Tensor], *, lr: float | torch.Tensor = 0.02,
         momentum: float = 0.95, nesterov: bool = True, ns_steps: int = NS_STEPS,
         ns_coefficients: Sequence[float] = NS_COEFFICIENTS, ns_eps: float = 1e-7,
         weight_decay: float = 0.0, scale_rule: str = "adamw", update_rms: float = 0.2,
         groups: Sequence[tuple[dict, int]] | None = None, kernel: str = "reference",
         ns_dtype: torch.dtype | None = torch.bfloat16,
         found_inf: torch.Tensor | None = None, replicas: Any = None,
         spread: bool = True) -> None:
    """One Muon step (the module docstring's update) over tensor lists, in place.

    ``params`` (plain tensors or DTensors, ``ndim >= 2``), their ``grads`` and momentum
    ``bufs`` (local tensors laid out like each parameter's local shard). The keywords hold
    one group's hyperparameters, or ``groups`` lists ``(options, count)`` runs covering
    ``params`` in order (options keyed like the keywords), so that every group's matrices
    are orthogonalised together: one exchange per step for sharded ones.
    ``kernel``: ``"reference"`` or ``"batched"``; ``ns_dtype``: the Newton-Schulz dtype of
    the batched kernel on CUDA. ``found_inf``: a 0-d overflow flag (GradScaler's); nonzero
    leaves everything unchanged. It is never read to the host: the step is computed and
    each new buffer and weight is chosen by the flag on the device (`torch.where`), so a
    zero flag gives the same bits as no flag. ``replicas`` and ``spread``: how the
    Newton-Schulz work is split between ranks that hold the same matrices
    (`bigbatch.optim.whole_matrices.apply_whole`).
    """
    if kernel not in ("reference", "batched"):
        raise ValueError(f"muon: kernel={kernel!r} should be 'reference' or 'batched'")
    if groups is None:
        groups = [(dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps,
                        weight_decay=weight_decay, scale_rule=scale_rule,
                        update_rms=update_rms), len(params))]
    if sum(n for _, n in groups) != len(params) or len(grads) != len(params) \
            or len(bufs) != len(params):
        raise ValueError(f"muon: groups cover {sum(n for _, n in groups)} tensors; got "
                         f"{len(params)} parameters, {len(grads)} gradients, {len(bufs)} buffers")
    skip = _flag(found_inf, params)
    opts_of = [opts for opts, n in groups for _ in range(n)]
    directions = []
    for w, g, b, opts in zip(params, grads, bufs, opts_of, strict=True):
        if w.ndim < 2:
            raise ValueError(f"muon: takes matrices (ndim >= 2); got a tensor of shape "
                             f"{tuple(w.shape)}: give it to AdamW (use_muon=False)")
        g_ = local(g)
        if skip is None:
            b.mul_(opts["momentum"]).add_(g_)
        else:
            b.copy_(torch.where(skip, b, b * opts["momentum"] + g_))
        directions.append(g_.add(b, alpha=opts["momentum"]) if opts["nesterov"] else b)
    # Groups differing only in lr / weight decay share one orthogonalisation.
    by_ns: dict = {}
    for i, opts in enumerate(opts_of):
        key = (opts["ns_steps"], tuple(opts["ns_coefficients"]), opts["ns_eps"])
        by_ns.setdefault(key, []).append(i)
    ortho: list = [None] * len(params)
    for idx in by_ns.values():
        fn = _orthogonalise(kernel, opts_of[idx[0]], ns_dtype)
        for i, o in zip(idx, apply_whole(fn, [directions[i] for i in idx],
                                         [params[i] for i in idx], replicas=replicas,
                                         spread=spread), strict=True):
            ortho[i] = o
    for w, o, opts in zip(params, ortho, opts_of, strict=True):
        rows = w.shape[0]
        cols = w.numel() // rows if rows else 0
        step = opts["lr"] * update_scale(opts["scale_rule"], rows, cols, opts["update_rms"])
        w_ = local(w)
        new = w_ if skip is None else w_.clone()
        if opts["weight_decay"]:
            new.mul_(1 - opts["lr"] * opts["weight_decay"])
        if isinstance(step, torch.Tensor):
            new.sub_(o * step)
        else:
            new.add_(o, alpha=-step)
        if skip is not None:
            w_.copy_(torch.where(skip, w_, new))


def _flag(found_inf: torch.Tensor | None, params: Sequence[torch.Tensor]
          ) -> torch.Tensor | None:
    """The overflow flag as a 0-d bool on the parameters' device (no host read), or None."""
    if found_inf is None or not params:
        return None
    return found_inf.to(local(params[0]).device).reshape(()).bool()


class Muon(EagerStepOptimizer):
    """Muon for hidden matrices and AdamW for the rest, in one optimizer.

    Args:
        params: param groups from `muon_param_groups(model, ...)` (each with ``use_muon``),
            or ``model.named_parameters()``: then tensors with ``ndim >= 2`` whose name
            contains none of ``adamw`` go to Muon, the rest to AdamW. Plain tensors without
            names: by ``ndim`` alone.
        lr: learning rate of both parts (with ``scale_rule="adamw"`` AdamW's own LR).
        momentum, nesterov: Muon's momentum (0.95, Nesterov: Jordan's and Moonlight's).
        ns_steps, ns_coefficients, ns_eps: the Newton-Schulz iteration (module docstring).
        weight_decay: decoupled, on both parts (``W *= 1 - lr * weight_decay``).
        scale_rule, update_rms: the Muon update's scale (``"adamw"``, ``"shape"``, ``"none"``).
        betas, eps: AdamW's, for the ``use_muon=False`` groups.
        adamw: name substrings that send a matrix to AdamW (embeddings, the output head).
        kernel: ``"auto"`` (``"batched"`` on CUDA, ``"reference"`` on CPU, where stacking
            measured slower), ``"reference"`` or ``"batched"``.
        ns_dtype: the Newton-Schulz dtype of the batched kernel on CUDA (bfloat16).
        replicas: the process group whose ranks hold these parameters whole and step them
            on the same gradients (DDP's: ``dist.group.WORLD`` in a plain DDP loop; never
            with local SGD or ZeRO-1's partitions): each matrix is orthogonalised on one
            of them, balanced by cost, and one all-gather a step shares the results.
            DTensor parameters name their replicated mesh dimensions themselves.
        spread_ns: False: every replica orthogonalises every matrix itself and sends
            nothing for it (neither ``replicas`` nor DTensors' replicated dimensions used).
    """

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = NS_STEPS,
                 ns_coefficients: Sequence[float] = NS_COEFFICIENTS, ns_eps: float = 1e-7,
                 weight_decay: float = 0.1, scale_rule: str = "adamw",
                 update_rms: float = 0.2, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, adamw: Sequence[str] = ("embed", "head"),
                 kernel: str = "auto", ns_dtype: torch.dtype | None = torch.bfloat16,
                 replicas: Any = None, spread_ns: bool = True):
        if not isinstance(lr, torch.Tensor):
            check_range("Muon", "lr", lr, 0.0)
        check_range("Muon", "momentum", momentum, 0.0, 1.0, high_open=True)
        check_range("Muon", "ns_steps", ns_steps, 0)
        if len(tuple(ns_coefficients)) != 3:
            raise ValueError(f"Muon: ns_coefficients={tuple(ns_coefficients)!r} should be "
                             "three numbers (a, b, c)")
        check_range("Muon", "ns_eps", ns_eps, 0.0, low_open=True)
        check_range("Muon", "weight_decay", weight_decay, 0.0)
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"Muon: scale_rule={scale_rule!r} should be one of {SCALE_RULES}")
        check_range("Muon", "update_rms", update_rms, 0.0, low_open=True)
        check_range("Muon", "betas[0]", betas[0], 0.0, 1.0, high_open=True)
        check_range("Muon", "betas[1]", betas[1], 0.0, 1.0, high_open=True)
        check_range("Muon", "eps", eps, 0.0)
        if kernel not in KERNELS:
            raise ValueError(f"Muon: kernel={kernel!r} should be one of {KERNELS}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps,
                        weight_decay=weight_decay, scale_rule=scale_rule,
                        update_rms=update_rms, betas=tuple(betas), eps=eps)
        super().__init__(split_muon_groups(params, tuple(adamw)), defaults)
        self.kernel = kernel
        self.ns_dtype = ns_dtype
        self.replicas = replicas
        self.spread_ns = spread_ns

    def ns_work(self) -> list[int]:
        """Newton-Schulz flops a step (2 per multiply-add, ``ns_steps`` iterations) of each
        rank the orthogonalisation of this rank's matrices is split over, as `muon` splits
        it (`bigbatch.optim.whole_matrices.split_work`); max over mean is its balance."""
        by_ns: dict = {}
        for group in self.param_groups:
            if group["use_muon"]:
                key = (group["ns_steps"], tuple(group["ns_coefficients"]), group["ns_eps"])
                by_ns.setdefault(key, []).extend(group["params"])
        total: list[int] = []
        for (steps, _, _), params in by_ns.items():
            loads = split_work(params, lambda shape, n=steps: 2 * n * ns_cost(shape),
                               self.replicas, self.spread_ns)
            total = [a + b for a, b in zip_longest(total, loads, fillvalue=0)]
        return total

    def _buffer(self, w: torch.Tensor) -> torch.Tensor:
        state = self.state[w]
        if "momentum_buffer" not in state:
            # zeros_like keeps a DTensor's placements (sharded checkpoints see a DTensor).
            state["momentum_buffer"] = torch.zeros_like(w)
        return local(state["momentum_buffer"])

    def _adam_state(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.state[w]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local(w).device)
            state["exp_avg"] = torch.zeros_like(w)
            state["exp_avg_sq"] = torch.zeros_like(w)
        return state["step"], local(state["exp_avg"]), local(state["exp_avg_sq"])

    def _step(self) -> None:
        # GradScaler's protocol: a set flag skips the step on the device, never read here.
        found_inf = getattr(self, "found_inf", None)
        matrices, runs = [], []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Muon does not support sparse gradients")
            if not params:
                continue
            align_group(group, params)
            if group["use_muon"]:
                matrices += params
                runs.append((group, len(params)))
            else:
                adamw_step(group, params, [self._adam_state(p) for p in params],
                           fused=self.kernel != "reference", found_inf=found_inf)
        if matrices:
            kernel = self.kernel
            if kernel == "auto":  # one product per shape pays on a GPU, not on CPU threads
                kernel = "batched" if local(matrices[0]).device.type == "cuda" else "reference"
            muon(matrices, [p.grad for p in matrices], [self._buffer(p) for p in matrices],
                 groups=runs, kernel=kernel, ns_dtype=self.ns_dtype, found_inf=found_inf,
                 replicas=self.replicas, spread=self.spread_ns)

