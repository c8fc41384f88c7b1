"""`MicroStep`: the context a training loop enters once per micro-batch.

It turns on autocast, holds back DDP's all-reduce (`no_sync`) on all but the
k-th micro-step of a merge window, scales and counts the loss in `backward`,
and on the k-th hands over to the run's step (see `bigbatch.engine`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from bigbatch.engine.amp_lists import amp_context
from bigbatch.engine.merge import MergeWindow

__all__ = ["MicroStep"]


class MicroStep:
    """One micro-step: enter around forward and backward, call `backward` (or `skip`) once.

    Built by `Run.micro_step()` from the parts it uses: the merge window, the loss
    scaler, the precision and loss contexts, and the run's step as callables.
    """

    __slots__ = ("_window", "_scaler", "_autocast", "_loss_parallel", "_local_sgd", "_timing",
                 "_finish", "_skip", "_add_time", "_check", "_ended", "_contexts", "is_last", "stepped",
                 "skipped", "_called", "_t0")

    def __init__(self, window: MergeWindow, *, scaler: Any, autocast: tuple[str, Any] | None,
                 loss_parallel: bool, local_sgd: Any, timing: Any,
                 finish: Callable[[float], bool], skip: Callable[[], None],
                 add_time: Callable[[float], None],
                 check: Callable[[torch.Tensor, bool], bool] | None = None,
                 ended: Callable[[BaseException], None] | None = None) -> None:
        self._window = window
        self._scaler = scaler
        self._autocast = autocast  # (device type, dtype[, white list, black list]) or None
        self._loss_parallel = loss_parallel
        self._local_sgd = local_sgd
        self._timing = timing
        self._finish, self._skip, self._add_time = finish, skip, add_time
        self._check = check  # nan_policy: True to skip the step instead of this backward
        self._ended = ended  # told of an error leaving the block (the run may close)
        self._contexts: list[Any] = []
        self.is_last = False
        """True on the k-th micro-step, the one that all-reduces and steps."""
        self.stepped = False
        """After the block: the optimizer stepped (False while merging, and on overflow)."""
        self.skipped = False
        """After the block: the optimizer step was skipped (fp16 inf/nan gradients, a
        non-finite loss under `nan_policy=skip`, `skip()`)."""
        self._called = False
        self._t0 = 0.0

    def __enter__(self) -> MicroStep:
        self._t0 = time.perf_counter()
        self.is_last = self._window.is_last
        self._contexts = self._window.sync_contexts()
        if self._loss_parallel:
            from bigbatch.parallel.tensor_parallel import loss_parallel_if

            self._contexts.append(loss_parallel_if(True))
        if self._autocast is not None:
            self._contexts.append(amp_context(*self._autocast))
        for ctx in self._contexts:
            ctx.__enter__()
        return self

    def backward(self, loss: torch.Tensor, count: float | torch.Tensor | None = None) -> None:
        """Backpropagate this micro-batch's loss with the strategy's scaling.

        `loss` is a mean over the micro-batch, or, with `count`, a sum over
        `count` items (the merged step then divides by the total count). Under the run's
        `nan_policy` a non-finite loss raises `NonFiniteLossError` here or has the step
        skipped (`ms.skipped`) on its last micro-step.
        """
        if self._called:
            raise RuntimeError("ms.backward() was called twice in one micro-step")
        if self._check is not None and self._check(loss, self.is_last):
            self.skip()
            return
        self._called = True
        mult = self._window.loss_multiplier(count)
        if self._local_sgd is not None:  # adaptive local SGD's interval follows the loss
            self._local_sgd.observe(loss, count)
        if mult != 1.0:
            loss = loss * mult
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        if self._autocast is not None:
            with torch.autocast(self._autocast[0], enabled=False):
                loss.backward()
        else:
            loss.backward()
        if self._timing is not None:
            self._timing.backward_done(self.is_last)

    def skip(self) -> None:
        """Instead of `backward`: drop this optimizer step (see `Run.skip_step`).

        No backward for this micro-batch; the merge window's gradients so far are
        dropped, the optimizer does not step and the schedule stays. With several
        workers every worker must skip alike (decide on an all-reduced flag).
        """
        if self._called:
            raise RuntimeError("ms.skip() after ms.backward() in one micro-step")
        self._called = True
        self.skipped = True
        self._skip()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        try:
            return self._exit(exc_type, exc, tb)
        except BaseException as e:
            exc = e  # raised by the step itself (a non-finite loss, say)
            raise
        finally:
            if exc is not None and self._ended is not None:
                self._ended(exc)

    def _exit(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        for ctx in reversed(self._contexts):
            ctx.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return False
        if not self._called:
            raise RuntimeError("call ms.backward(loss) inside `with run.micro_step() as ms:`")
        if self.skipped:  # skip(): the window is gone
            return False
        if self.is_last:
            self.skipped = self._finish(self._t0)
            self.stepped = not self.skipped
        else:
            self._window.end_micro()
            self._add_time(self._t0)
        return False
