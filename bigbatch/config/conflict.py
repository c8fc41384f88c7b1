"""A row of the compatibility table (`bigbatch.config.compat`): `Conflict`, and the
`Context` a check runs in (what it knows besides the strategy)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKED_BY", "NO_CONTEXT", "Conflict", "Context"]


@dataclass(frozen=True)
class Context:
    """What a check knows besides the strategy; None: not known where it runs (rows that
    need the fact are skipped there)."""

    run: bool | None = None
    """A run is being set up from the strategy (`prepare()`; the preflight once the world
    size is known), not only a strategy written down."""
    own_optimizer: bool | None = None
    """`prepare(..., optimizer=...)`: the user's own optimizer."""
    tp_plan: bool | None = None
    """A tensor-parallel plan was given for the model (`prepare(..., tp_plan=...)`)."""
    distributed: bool | None = None
    """This worker is one of several (`prepare()`)."""
    device: str | None = None
    """This worker's device type, e.g. "cuda", "cpu" (`prepare()`)."""
    cuda: bool | None = None
    """This machine has CUDA devices (the preflight, before any worker starts)."""
    world_size: int | None = None
    """The world size where known (the preflight: None for an elastic range). Data only:
    no row needs it."""
    fsdp_unused: bool | None = None
    """This torch's FSDP2 can reduce zero gradients for the parameters a rank did not use
    (`FSDPModule.set_reduce_scatter_unused_params`, torch 2.13 or newer; `prepare()` and
    the preflight, from `bigbatch.parallel.sharding.fsdp_reduces_unused`)."""


NO_CONTEXT = Context()
"""Nothing known besides the strategy: `Strategy`'s own validation."""

CHECKED_BY = {"run": "prepare(), preflight", "own_optimizer": "prepare()",
              "tp_plan": "prepare()", "distributed": "prepare()", "device": "prepare()",
              "cuda": "preflight", "fsdp_unused": "prepare(), preflight"}
"""Where a row that needs this `Context` fact is checked (rows that need none: Strategy)."""


@dataclass(frozen=True)
class Conflict:
    """One row of the table: `a` with `b` is refused when `when(strategy, context)`."""

    key: str
    """A short stable name (test ids, the docs' anchors)."""
    a: str
    """The feature the message starts from, as a user writes it."""
    b: str
    """What it does not combine with: another feature or a condition."""
    when: Callable[[Any, Context], bool]
    """Whether the row applies; reads the strategy's sections only (no methods)."""
    text: str
    """The message, a `str.format` template over `s` (the strategy), `c` (the context),
    `a`, `b`, `reason`, `fix` and `values`."""
    reason: str
    """Why they do not combine."""
    fix: str
    """What to do instead."""
    example: Mapping[str, Mapping[str, Any]]
    """A minimal strategy (TOML tables) that this row, and no row before it, refuses."""
    given: Context = NO_CONTEXT
    """The facts besides the strategy the example needs; the row needs them known."""
    values: Callable[[Any, Context], Mapping[str, Any]] | None = None
    """Further names for `text`, computed from the strategy and context."""

    @property
    def needs(self) -> tuple[str, ...]:
        """The `Context` facts this row reads: those its `given` sets."""
        return tuple(f.name for f in dataclasses.fields(Context)
                     if getattr(self.given, f.name) is not None)

    @property
    def checked_by(self) -> str:
        """Where the row is checked: "Strategy", "prepare()", "preflight", ..."""
        return CHECKED_BY[self.needs[0]] if self.needs else "Strategy"

    def applies(self, strategy: Any, context: Context = NO_CONTEXT) -> bool:
        return (all(getattr(context, n) is not None for n in self.needs)
                and bool(self.when(strategy, context)))

    def message(self, strategy: Any, context: Context = NO_CONTEXT) -> str:
        """The one line the user sees."""
        extra = self.values(strategy, context) if self.values is not None else {}
        return self.text.format(s=strategy, c=context, a=self.a, b=self.b, reason=self.reason,
                                fix=self.fix, **extra)
