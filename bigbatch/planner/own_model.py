"""Planning your own model: `bigbatch plan --model module:function`.

The function builds the model (it is called under ``torch.device("meta")``, once per
pipeline stage, with the ``--model-opt`` keywords); the model's plan comes from, in order,
``--model-plan module:name`` (a `ModelPlan`, or a function of the model returning one),
the model's own ``model_plan()`` method, or nothing (no tensor-parallel plan; pipeline
layers from ``model.pipeline_layers()``). The model takes token ids ``(batch, seq_len)``
and returns logits ``(batch, seq_len, vocab)``; the loss is their cross-entropy.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.errors import ConfigError

__all__ = ["load_object", "lm_loss", "plan_model", "token_example"]


def load_object(spec: str, flag: str) -> Any:
    """``package.module:name`` or ``path/to/file.py:name`` -> the object (the current
    directory importable, as ``python -m`` makes it)."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"{flag} {spec!r}: expected module:function "
                          "(e.g. examples.llama:llama3_8b)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"{flag} {spec!r}: no file {module_name}")
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{flag} {spec!r}: cannot import {module_name} ({e})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{flag} {spec!r}: {module_name} has no {name!r}")
    return getattr(module, name)


def token_example(seq_len: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def example(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.empty((micro, seq_len), dtype=torch.long, device="meta")
        return ids, ids
    return example


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of logits over the vocabulary (sharded logits: under
    loss_parallel, as the planner runs a tensor-parallel probe)."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")
    if type(loss) is not torch.Tensor:
        from bigbatch.parallel.tensor_parallel import loss_value

        loss = loss_value(loss)
    return loss


def _model_plan(model: nn.Module, plan_spec: str | None) -> Any:
    if plan_spec is not None:
        found = load_object(plan_spec, "--model-plan")
        return found(model) if callable(found) and not hasattr(found, "tp_plan") else found
    own = getattr(model, "model_plan", None)
    return own() if callable(own) else own


def model_parts(spec: str, *, options: dict[str, Any], seq_len: int | None,
                plan_spec: str | None = None) -> tuple[Any, Any, Any, Any]:
    """(model_fn, example, loss, model plan) of the model ``spec`` builds."""
    build = load_object(spec, "--model")
    if not callable(build):
        raise ConfigError(f"--model {spec!r}: not a function")

    def model_fn() -> nn.Module:
        try:
            model = build(**options)
        except TypeError as e:
            raise ConfigError(f"--model {spec!r} with --model-opt {options}: {e}") from None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"--model {spec!r}: returned {type(model).__name__}, "
                              "not an nn.Module")
        return model

    with torch.device("meta"):
        probe_model = model_fn()
    model_plan = _model_plan(probe_model, plan_spec)
    if seq_len is None:
        seq_len = getattr(probe_model, "max_seq_len", None)
        if seq_len is None:
            raise ConfigError(f"--model {spec!r}: give --seq-len (the model has no "
                              "max_seq_len)")
    return model_fn, token_example(seq_len), lm_loss, model_plan


def plan_model(spec: str, strategy: Any, world: int, *, options: dict[str, Any],
               seq_len: int | None, plan_spec: str | None = None,
               gpu_memory: float | None = None, probes: dict | None = None,
               ends_only: bool = False) -> Any:
    """`bigbatch.planner.planning._plan` for the model ``spec`` builds (module docstring)."""
    from bigbatch.planner.planning import _plan

    model_fn, example, loss, model_plan = model_parts(spec, options=options, seq_len=seq_len,
                                                      plan_spec=plan_spec)
    tp_plan = getattr(model_plan, "tp_plan", None)
    layers = getattr(model_plan, "pipeline_layers", None)
    return _plan(model_fn, strategy, world, example=example, loss=loss,
                 tp_plan_of=lambda model: tp_plan, tp_given=tp_plan is not None,
                 pipeline_layers=layers, gpu_memory=gpu_memory, probes=probes,
                 ends_only=ends_only)
