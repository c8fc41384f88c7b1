"""Parameters one rank leaves without a gradient under FSDP2 (ZeRO stage 2-3), named
before the reduction they would break.

FSDP2 reduce-scatters the gradients of a unit's parameters that got one in backward:
a parameter one rank does not use (a branch it skips) makes that rank's reduction
smaller than its peers', and gloo aborts the process on the size mismatch (SIGABRT;
NCCL hangs or corrupts). A whole block one rank skips pairs its peers' gathers with
the wrong ones (a hang, or the same abort). With `data_parallel.find_unused_parameters`
on torch 2.13 or newer, FSDP2 reduces a zero gradient for a parameter of a module that
ran but that a rank did not use (`bigbatch.parallel.sharding.reduce_unused`), as DDP's
pass does; a whole block one rank skips still breaks the gathers (FSDP2 gathers a
block's parameters in its forward on every rank).

`UnusedCheck` sees it coming in the first `steps` optimizer steps. Before each FSDP2
module's forward (before its gathers) the data ranks say which module they are at (an
all-gather of two integers): a rank elsewhere skipped it. Before each micro-step's
backward it walks the loss's autograd graph to the parameters it reaches (the
unsharded ones FSDP2 put on the modules in forward, recorded by a forward pre-hook on
each FSDP2 module), and before the window's last backward, the one that reduces, the
ranks exchange which parameters they used (an all-gather of a byte per parameter).
Either ends the run with `UnusedParametersError`, the same line on every rank, naming
the parameters and the ranks that skipped them; where FSDP2 reduces zeros for unused
parameters only a skipped block is an error (no graph walk, no exchange of what was
used). After those steps the hooks are removed and later steps run with nothing added
(a part first skipped later still aborts, with the launcher's line about a collective
that differs between ranks). A parameter no rank uses is fine for FSDP2 and is not
reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.errors import on_every_rank
from bigbatch.parallel.data_parallel import UnusedParametersError

__all__ = ["CHECKED_STEPS", "UnusedCheck", "reached_leaves", "skipped_module_line",
           "unused_line"]

CHECKED_STEPS = 3
"""Optimizer steps `UnusedCheck` checks: small all-gathers per FSDP2 module and per
step, read on the host (a device sync on CUDA), and a graph walk per micro-step."""


_STAGE1 = ("(without tensor parallelism) sharding.stage = 1 with "
           "data_parallel.find_unused_parameters = true")
_FIX = f"use every parameter in forward on every rank, or {_STAGE1}"
_FIX_OPTION = ("set data_parallel.find_unused_parameters = true (FSDP2 then reduces zeros for "
               "them), or use every parameter in forward on every rank")
_FIX_BLOCK = ("run every block on every rank (where a rank does not want one, add 0 * its "
              f"output, so that its backward runs too), or {_STAGE1}")


def reached_leaves(loss: torch.Tensor) -> set[int]:
    """Ids of the leaf tensors whose gradient `loss.backward()` would accumulate: the
    variables of the `AccumulateGrad` nodes its autograd graph reaches."""
    out: set[int] = set()
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            out.add(id(variable))
        stack.extend(n for n, _ in node.next_functions)
    return out


def unused_line(names: list[str], skipped: dict[int, list[int]], step: int,
                can_reduce: bool = False) -> str:
    """One line: which parameters (indices into `names`) which ranks left without a
    gradient (`skipped`: rank -> indices) in optimizer step `step`; `can_reduce`: the fix
    is `data_parallel.find_unused_parameters` (ZeRO-2/3 on a torch that has FSDP2's pass)."""
    by_set: dict[tuple[int, ...], list[int]] = {}
    for rank, idx in sorted(skipped.items()):
        by_set.setdefault(tuple(idx), []).append(rank)
    parts = []
    for idx, ranks in by_set.items():
        shown = [names[i] for i in idx[:8]]
        more = f" and {len(idx) - 8} more" if len(idx) > 8 else ""
        where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        parts.append(f"{', '.join(shown)}{more} on {where}")
    return (f"parameter(s) {'; '.join(parts)} got no gradient in optimizer step {step} while "
            "other ranks' did (a part of the model that worker did not use); FSDP2 "
            f"reduces every parameter's gradient on every rank, so the reductions would not "
            f"match: {_FIX_OPTION if can_reduce else _FIX}")


def skipped_module_line(unit: str, names: list[str], skipped: list[int], ran: list[int],
                        step: int) -> str:
    """One line: FSDP2 module `unit` (parameters `names`) ran on ranks `ran`, not on
    `skipped`, in optimizer step `step`."""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"module {unit or '(the root)'} (parameter(s) {shown}) did not run on "
            f"rank{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))} in "
            f"optimizer step {step} while rank{'s' if len(ran) > 1 else ''} "
            f"{', '.join(map(str, ran))} ran it; FSDP2 gathers each block's parameters in "
            f"its forward on every rank, so the collectives would not match "
            f"(data_parallel.find_unused_parameters covers parameters of a block that ran, "
            f"not a block that did not run): {_FIX_BLOCK}")


_UNIT, _BACKWARD = 1, 2  # where a rank is when the ranks compare: a module's forward, backward


class UnusedCheck:
    """The first `steps` optimizer steps of an FSDP2 `module`: parameters used on some
    data ranks of `group` and not on others end the run in one line (module docstring).

    Before each FSDP2 module's forward (and its gathers) the ranks compare which module
    they are at, so a block one rank skips is named before the gathers go astray; call
    `before_backward(loss, is_last)` before each micro-step's backward. `step()` gives
    the optimizer step being taken (for the line). `active` turns False, and the hooks
    go, after `steps` windows. `reduced`: FSDP2 reduces zeros for unused parameters here
    (only a skipped module is an error); `can_reduce`: it would with
    `data_parallel.find_unused_parameters` (the line says so).
    """

    def __init__(self, module: nn.Module, group: Any, device: torch.device,
                 step: Callable[[], int], steps: int = CHECKED_STEPS, *,
                 reduced: bool = False, can_reduce: bool = False) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        """Trainable parameters by name, the order of the exchanged mask."""
        self._index = {n: i for i, n in enumerate(self.names)}
        self._group = group
        self._device = device
        self._step = step
        self._left = int(steps)
        self._reduced = reduced
        self._can_reduce = can_reduce
        self._by_id: dict[int, int] = {}  # id of a parameter as forward used it -> index
        self._used: set[int] = set()
        self._units = [(prefix, sub) for prefix, sub in module.named_modules()
                       if isinstance(sub, FSDPModule)]
        self._handles = []
        for i, (prefix, sub) in enumerate(self._units):
            # Before FSDP2's pre-forward hook (its gathers), and after it (the unsharded
            # parameters it put on the modules, which autograd will see).
            self._handles.append(sub.register_forward_pre_hook(self._arrive_at(i), prepend=True))
            if not reduced:
                self._handles.append(sub.register_forward_pre_hook(self._record(prefix)))

    @property
    def active(self) -> bool:
        return self._left > 0

    def _record(self, prefix: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            for name, p in module.named_parameters():
                i = self._index.get(f"{prefix}.{name}" if prefix else name)
                if i is not None:
                    self._by_id[id(p)] = i
        return hook

    def _arrive_at(self, unit: int) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self._compare(_UNIT, unit)
        return hook

    def _gather(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Every data rank's `values`, one row per rank (on the host)."""
        mine = torch.tensor(values, dtype=dtype, device=self._device)
        world = dist.get_world_size(self._group)
        out = torch.empty(world * len(values), dtype=dtype, device=self._device)
        # torch 2.13's name for what 2.11 calls all_gather_into_tensor (deprecated there).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=self._group)
        return out.view(world, -1).cpu()

    def _compare(self, kind: int, unit: int) -> None:
        """The ranks say where they are; where they differ, the earliest place is a module
        the others skipped."""
        places = self._gather([kind, unit], torch.int64).tolist()
        if all(p == places[0] for p in places):
            return
        ranks = dist.get_process_group_ranks(self._group)
        first = min(places, key=lambda p: (p[0], p[1]))
        ran = [ranks[r] for r, p in enumerate(places) if p == first]
        skipped = [ranks[r] for r, p in enumerate(places) if p != first]
        prefix, sub = self._units[first[1]]
        names = [f"{prefix}.{n}" if prefix else n for n, p in sub.named_parameters()
                 if p.requires_grad]
        self.remove()
        raise on_every_rank(UnusedParametersError(
            skipped_module_line(prefix, names, skipped, ran, self._step())))

    def before_backward(self, loss: torch.Tensor, is_last: bool) -> None:
        """Note what this micro-step's backward reaches; on the window's last, the one
        that reduces, compare with the other data ranks (collectives: every rank calls
        it alike)."""
        if not self.active:
            return
        if not self._reduced:
            for leaf in reached_leaves(loss):
                i = self._by_id.get(leaf)
                if i is not None:
                    self._used.add(i)
        if not is_last:
            return
        self._compare(_BACKWARD, 0)  # a rank that skipped the last block is elsewhere
        used, self._used, self._by_id = self._used, set(), {}
        self._left -= 1
        if not self.active:
            self.remove()
        if self._reduced:
            return
        masks = self._gather([int(i in used) for i in range(len(self.names))], torch.uint8)
        somewhere = masks.any(dim=0)
        ranks = dist.get_process_group_ranks(self._group)
        skipped = {ranks[r]: idx for r in range(len(ranks))
                   if (idx := torch.nonzero(somewhere & ~masks[r].bool()).flatten().tolist())}
        if skipped:
            self.remove()
            raise on_every_rank(UnusedParametersError(
                unused_line(self.names, skipped, self._step(), self._can_reduce)))

    def remove(self) -> None:
        """Stop checking: the forward hooks go."""
        self._left = 0
        for handle in self._handles:
            handle.remove()
        self._handles = []
