"""The shell shared by LARS and LAMB: groups, kernel choice, trust-ratio log."""

from __future__ import annotations

import abc
import importlib
import sys
from collections.abc import Iterable, Sequence

import torch

from ._norms import local
from ._params import split_by_exclusion
from .layouts import align_group
from .warm_start import adopt

# Dtypes torch's fused CPU kernels accept; the per-tensor kernel needs them.
_FUSED_DTYPES = (torch.float32, torch.float64)

KERNELS = ("auto", "reference", "per_tensor", "multi_tensor", "triton")

# Parameter dtypes whose optimizer state the Triton kernel keeps in float32.
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class EagerStepOptimizer(torch.optim.Optimizer):
    """An optimizer whose update (`_step`) always runs eagerly. ``step(closure)`` is
    torch's protocol; under ``torch.compile`` (of the step, or of a function that calls
    it) Dynamo breaks the graph at `_eager` and the kernel runs as written, so a compiled
    step equals the eager one. Traced, the kernels' host reads (``.item()``, Python-float
    trust ratios) became constants of the graph and gave other weights without an error."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._eager()
        return loss

    @torch.compiler.disable
    def _eager(self) -> None:
        self._step()

    def _step(self) -> None:
        """The update of every group."""
        raise NotImplementedError


class LayerwiseOptimizer(EagerStepOptimizer, metaclass=abc.ABCMeta):
    """Base for layer-wise adaptive optimizers (one trust ratio per tensor).

    Subclasses set ``_name`` and implement ``_update(work, kernel, ratios)``
    over all groups at once, so the norms of a step are reduced together (one
    collective per step for sharded parameters).

    Kernels (``kernel=``):

    - ``"reference"``: the readable per-tensor loop, the spec (``fast=False``);
    - ``"per_tensor"``: torch's fused CPU kernels one tensor at a time (small
      tensors a block at a time in one multi-tensor call), norms read to the
      host once per tensor or block, trust-ratio rules on Python floats (see
      ``_blocks`` and ``_lamb_cpu``); fastest on CPU. Tensors whose layout the
      fused kernels cannot take (non-dense views, gradients or state laid out
      unlike the parameter) take the reference kernel. DTensor parameters
      (FSDP2, tensor parallel) take the fused kernels on their local shards,
      after one all-reduce of every tensor's squared norms;
    - ``"multi_tensor"``: lists of tensors per (device, dtype), norms and trust
      ratios kept as tensors: no host synchronisation, capturable in a CUDA
      graph, and whole-tensor norms for DTensor (FSDP2, tensor parallel) shards;
    - ``"triton"``: Triton kernels over all tensors of one CUDA device at once,
      a handful of launches per step whatever the tensor count; no host
      synchronisation, capturable, bitwise repeatable; DTensor shards take it
      with one all-reduce of all squared norms. State of bfloat16/float16
      parameters it creates in float32 (see ``_triton_steps``);
    - ``"auto"`` (default): ``triton`` for CUDA parameters when Triton imports
      (else ``multi_tensor``), ``per_tensor`` for float32/float64 CPU
      parameters (DTensor shards included), ``reference`` otherwise.
    """

    _name = "optimizer"

    def __init__(self, params: Iterable, defaults: dict, exclude: Sequence[str] = (),
                 fast: bool | None = None, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"{self._name}: kernel={kernel!r} should be one of {KERNELS}")
        if fast is False and kernel not in ("auto", "reference"):
            raise ValueError(f"{self._name}: fast=False means kernel='reference', "
                             f"not {kernel!r}")
        if isinstance(exclude, str):
            exclude = (exclude,)
        groups = split_by_exclusion(self._name, params, tuple(exclude))
        # No "layer_adaptation" default: a group that does not say takes `_adapts`'s rule.
        super().__init__(groups, defaults)
        self.fast = fast
        self.kernel = "reference" if fast is False else kernel
        self.track_trust_ratios = False
        self._last_ratios: list | None = None
        # The Triton kernel's device tables, kept between steps (see ``_triton_plan``).
        self._workspace: dict = {}

    # Subclasses: their state's keys, and how another optimizer's state converts
    # (`bigbatch.optim.warm_start`): (function, what it accepts, in words).
    _state_keys: tuple[str, ...] = ()
    _warm_start: tuple = ()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then every 0-d state tensor (LAMB's step, LARS's local_lr) moved to its
        parameter's device: torch keeps a loaded ``step`` on the CPU, and the kernels that
        never read to the host (multi-tensor, Triton) want it beside the parameter.

        Another optimizer's state dict (LAMB from AdamW, LARS from momentum SGD) is
        converted, keeping this optimizer's hyperparameters, or refused in one line
        (`bigbatch.optim.warm_start`)."""
        if self._warm_start:
            convert, accepted = self._warm_start
            params = [p for g in self.param_groups for p in g["params"]]
            state_dict = adopt(self._name, super().state_dict(), params, state_dict,
                               self._state_keys, convert, accepted)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                here = local(p).device
                for key, value in (state or {}).items():
                    if isinstance(value, torch.Tensor) and value.ndim == 0 \
                            and value.device != here:
                        state[key] = value.to(here)

    def _choose_kernel(self, params: list[torch.Tensor]) -> str:
        if self.kernel != "auto":
            return self.kernel
        if any(p.device.type != "cpu" for p in params):
            return "triton" if _triton_fits(params) else "multi_tensor"
        if all(p.dtype in _FUSED_DTYPES for p in params):
            return "per_tensor"
        return "multi_tensor" if self.fast else "reference"

    def _step(self) -> None:
        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError(f"{self._name} does not support sparse gradients")
            if params:
                align_group(group, params)
                work.append((group, params))
        ratios: list | None = [] if self.track_trust_ratios else None
        if work:
            kernel = self._choose_kernel([p for _, params in work for p in params])
            # GradScaler's protocol (torch's fused optimizers read the same attribute).
            self._update(work, kernel, ratios, getattr(self, "found_inf", None))
        self._last_ratios = ratios

    @abc.abstractmethod
    def _update(self, work: list[tuple[dict, list[torch.Tensor]]], kernel: str,
                ratios: list | None, found_inf: torch.Tensor | None = None) -> None:
        """Update every group's parameters that have gradients with ``kernel``; none
        where the overflow flag ``found_inf`` is set (``self.found_inf``, the protocol of
        torch's GradScaler: the engine sets it for fp16 steps skipped on the device).

        Appends the trust ratios to ``ratios`` (floats or tensors) in parameter order.
        """

    @staticmethod
    def _adapts(group: dict) -> bool:
        """Whether ``group``'s tensors take the trust ratio: the group's own
        ``layer_adaptation`` (True/False) when it has one, else only when its
        ``weight_decay`` is nonzero (timm's rule: groups built elsewhere, by a trainer or
        ``weight_decay=0``, keep biases and norms on a plain step); ``always_adapt``
        overrides both."""
        if group["always_adapt"]:
            return True
        said = group.get("layer_adaptation")
        return bool(said) if said is not None else group["weight_decay"] != 0

    def trust_ratios(self) -> torch.Tensor | None:
        """Per-tensor trust ratios of the last step, in parameter order.

        Recorded only while ``track_trust_ratios`` is True; ``None`` otherwise.
        The multi-tensor kernel keeps them as device tensors, read here (so
        only this call synchronises). For LARS the ratio is ``local_lr / lr``;
        for LAMB ``||w|| / ||u||``. Excluded tensors show 1.
        """
        if self._last_ratios is None:
            return None
        parts = [torch.as_tensor(r, dtype=torch.float64, device="cpu").reshape(-1)
                 if not isinstance(r, torch.Tensor)
                 else r.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
                 for r in self._last_ratios]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    def param_names(self) -> list[str | None]:
        """Names of the parameters in step order (None where not given)."""
        names: list[str | None] = []
        for group in self.param_groups:
            given = group.get("param_names")
            names.extend(given if given is not None else [None] * len(group["params"]))
        return names


def _triton_fits(params: list[torch.Tensor]) -> bool:
    """Whether the Triton kernel takes these: all on one CUDA device, Triton importable."""
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return False
    return _triton_imports()


def _triton_imports() -> bool:
    """Whether Triton imports here (asked for CUDA parameters only, never on CPU)."""
    if "triton" in sys.modules:
        return True
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def state_dtype(w: torch.Tensor, kernel: str) -> torch.dtype:
    """The dtype of new optimizer state for ``w``: ``w``'s own, except float32 for
    bfloat16/float16 parameters under the Triton kernel (moments rounded to 8 bits
    of mantissa every step would lose small updates)."""
    if kernel == "triton" and w.dtype in _LOW_PRECISION:
        return torch.float32
    return w.dtype


def split_runs(groups, params, grads, states) -> list[tuple]:
    """``(options, params, grads, states)`` per ``(options, count)`` of ``groups``."""
    runs = []
    start = 0
    for opts, count in groups:
        runs.append((opts, params[start:start + count], grads[start:start + count],
                     states[start:start + count]))
        start += count
    if start != len(params) or len(grads) != start or len(states) != start:
        raise ValueError(f"groups cover {start} tensors; got {len(params)} parameters, "
                         f"{len(grads)} gradients and {len(states)} states")
    return runs


def in_param_order(buckets: list[list[int]], parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-bucket 1-d results back in parameter order (a single bucket stays whole)."""
    if len(parts) == 1:
        return parts
    slots: list = [None] * sum(len(idx) for idx in buckets)
    for idx, part in zip(buckets, parts, strict=True):
        for i, value in zip(idx, part.unbind(), strict=True):
            slots[i] = value
    return slots


def fusable(*tensors: torch.Tensor) -> bool:
    """Whether torch's fused kernels, which walk raw memory, can take these together.

    They need every tensor dense (no gaps, no overlap) with identical strides;
    ``empty_like``/``zeros_like`` of a dense parameter keep its strides (also
    for transposed and ``channels_last`` weights).
    """
    first = tensors[0]
    if not dense(first):
        return False
    shape, stride = first.shape, first.stride()
    return all(t.stride() == stride and t.shape == shape for t in tensors[1:])


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory with no gaps and no overlap (any dim order)."""
    # Non-overlapping and dense: the strides, sorted, are those of a contiguous tensor.
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def as_state_tensor(value, like: torch.Tensor) -> torch.Tensor:
    """A scalar state entry as a 0-d tensor on ``like``'s device and dtype.

    Old state dicts stored some scalars as Python floats; they convert on use.
    """
    if isinstance(value, torch.Tensor):
        if value.device == like.device and value.dtype == like.dtype:
            return value
        return value.to(device=like.device, dtype=like.dtype)
    return torch.full((), float(value), dtype=like.dtype, device=like.device)
