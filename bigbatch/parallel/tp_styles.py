"""Tensor-parallel styles torch does not ship: whole parameters as Replicate DTensors, and
Megatron's column/row split for layers that store their weight transposed (``(in, out)``,
Hugging Face's ``Conv1D``). `bigbatch.parallel.tensor_parallel` names them in its plans."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from bigbatch.errors import ConfigError

__all__ = ["ReplicateParallel", "TransposedColwise", "TransposedRowwise"]


class ReplicateParallel(ParallelStyle):
    """A module's parameters and buffers as Replicate DTensors (rank 0's values, like the
    other styles); its tensor inputs are taken as replicated and its outputs given back as
    plain tensors. Gradients need no communication: every rank computes the same ones."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, _inputs_as_replicated,
                                 _outputs_as_local)


def _inputs_as_replicated(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
                 if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
                 for t in inputs)


def _outputs_as_local(module: nn.Module, outputs, mesh: DeviceMesh):
    if isinstance(outputs, tuple | list):
        return type(outputs)(_outputs_as_local(module, o, mesh) for o in outputs)
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _transposed_params(style: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Shard a transposed linear layer (weight ``(in, out)``, HF's ``Conv1D``): colwise
    splits the outputs (weight dim 1, bias dim 0), rowwise the inputs (weight dim 0, the
    bias whole, added once after the sum)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise ConfigError(f"tensor-parallel plan: {style} needs a module with a 2-D weight "
                          f"stored (in, out); {type(module).__name__} has none")
    for name, p in list(module.named_parameters(recurse=False)):
        if style == "conv1d_colwise":
            placement = Shard(1) if name == "weight" else Shard(0)
        else:
            placement = Shard(0) if name == "weight" else Replicate()
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(p, device_mesh, [placement]), requires_grad=p.requires_grad))


class TransposedColwise(ColwiseParallel):
    """`ColwiseParallel` for a layer that stores its weight ``(in, out)`` (HF ``Conv1D``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, lambda _n, m, mesh: _transposed_params("conv1d_colwise", m, mesh),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class TransposedRowwise(RowwiseParallel):
    """`RowwiseParallel` for a layer that stores its weight ``(in, out)`` (HF ``Conv1D``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # The rows of the weight are the inputs: they arrive sharded on the last dim.
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, lambda _n, m, mesh: _transposed_params("conv1d_rowwise", m, mesh),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
