"""Recompute (Fleet's `recompute`): named submodules drop their activations in forward
and recompute them in backward, through `torch.utils.checkpoint`."""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bigbatch.errors import ConfigError

__all__ = ["apply_recompute", "check_recompute"]


class _Recomputed:
    """A module's forward run under `torch.utils.checkpoint` (non-reentrant).

    Installed as the *instance* attribute `forward`, so parameter names and
    state_dict keys stay exactly those of the user's model. It holds the module
    itself (not a bound method) so `copy.deepcopy` and pickling follow the copy.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, names: list[str]) -> list[str]:
    """Make the named submodules recompute their activations in backward.

    Unknown names are a ConfigError that lists the closest existing names.
    Returns the names wrapped.
    """
    modules = check_recompute(model, names)
    for name in names:
        module = modules[name]
        if not isinstance(module.__dict__.get("forward"), _Recomputed):
            module.forward = _Recomputed(module)
    return list(names)


def check_recompute(model: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    """A ConfigError naming the closest existing names when one of `names` is no
    submodule of `model`; else `model`'s modules by name."""
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules or name == "":
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(
                f"recompute.checkpoints: no module named {name!r} in the model{hint} "
                "(names as in model.named_modules())"
            )
    return modules
