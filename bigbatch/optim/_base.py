"""The shell shared by LARS and LAMB: groups, kernel choice, trust-ratio log."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

import torch

from ._params import split_by_exclusion

# Dtypes torch's fused CPU/CUDA optimizer kernels accept; others use the reference kernel.
_FUSED_DTYPES = (torch.float32, torch.float64)


class LayerwiseOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """Base for layer-wise adaptive optimizers (one trust ratio per tensor).

    Subclasses set ``_name`` and implement ``_group_step(group, fast, ratios)``.
    ``fast=None`` picks the fast kernel where torch's fused kernels support
    the parameters, ``fast=False`` forces the per-tensor reference kernel.
    """

    _name = "optimizer"

    def __init__(self, params: Iterable, defaults: dict, exclude: Sequence[str] = (),
                 fast: bool | None = None):
        if isinstance(exclude, str):
            exclude = (exclude,)
        groups = split_by_exclusion(self._name, params, tuple(exclude))
        defaults = {**defaults, "layer_adaptation": True}
        super().__init__(groups, defaults)
        self.fast = fast
        self.track_trust_ratios = False
        self._last_ratios: list[float] | None = None

    def _use_fast(self, params: list[torch.Tensor]) -> bool:
        if self.fast is not None:
            return self.fast
        return all(p.dtype in _FUSED_DTYPES and not p.is_sparse for p in params)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._before_step()
        ratios: list[float] | None = [] if self.track_trust_ratios else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError(f"{self._name} does not support sparse gradients")
            self._group_step(group, params, self._use_fast(params), ratios)
        self._last_ratios = ratios
        return loss

    def _before_step(self) -> None:
        """Hook for work over all groups before the per-group updates."""

    @abc.abstractmethod
    def _group_step(self, group: dict, params: list[torch.Tensor], fast: bool,
                    ratios: list[float] | None) -> None:
        """Update one group's parameters that have gradients; append their trust ratios."""

    @staticmethod
    def _adapts(group: dict) -> bool:
        return bool(group["layer_adaptation"] or group["always_adapt"])

    def trust_ratios(self) -> torch.Tensor | None:
        """Per-tensor trust ratios of the last step, in parameter order.

        Recorded only while ``track_trust_ratios`` is True (it costs a list
        append per tensor); ``None`` otherwise. For LARS the ratio is
        ``local_lr / lr``; for LAMB ``||w|| / ||u||``. Excluded tensors show 1.
        """
        if self._last_ratios is None:
            return None
        return torch.tensor(self._last_ratios, dtype=torch.float64)

    def param_names(self) -> list[str | None]:
        """Names of the parameters in step order (None where not given)."""
        names: list[str | None] = []
        for group in self.param_groups:
            given = group.get("param_names")
            names.extend(given if given is not None else [None] * len(group["params"]))
        return names
