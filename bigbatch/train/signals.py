"""Stopping on a signal: SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C), SIGHUP.

While a run trains, the first such signal only asks it to stop (rank 0 says so on stderr
at once: "bigbatch: SIGINT: stopping after this step, ..."): every worker finishes
the optimizer step it is in, they agree (one all-reduce of a flag per step) on the
step to stop after, save a checkpoint there and raise `Stopped`; the CLI prints one
line and exits with 128 + the signal's number (143, 130, 129), and `--resume`
continues exactly. A second SIGINT interrupts at once (KeyboardInterrupt), and the CLI
says which checkpoint, if any, there is to resume from (`checkpoint_note`).

Before training starts (checks, data, rendezvous) there is nothing to save:
`abort_on_signals` makes SIGTERM and SIGHUP end the process at once, as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SIGNALS", "StopSignals", "Stopped", "abort_on_signals", "checkpoint_note",
           "exit_status"]

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by `signum`: 128 + its number."""
    return 128 + int(signum)


class Stopped(BaseException):
    """The run stopped on a signal (a BaseException, as KeyboardInterrupt: not an error to
    catch and carry on from). `step` and `checkpoint` are None when it stopped before
    training started."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: Path | None = None):
        self.signum, self.step, self.checkpoint = int(signum), step, checkpoint
        super().__init__(self.message())

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def message(self) -> str:
        if self.step is None:
            return f"stopped by {self.name} before training started; nothing was written"
        return (f"stopped by {self.name} after step {self.step}; checkpoint {self.checkpoint}; "
                "continue with --resume")


def checkpoint_note(out: str | Path) -> str:
    """What an interrupted run left to resume from (a second Ctrl-C does not wait for the
    stop's checkpoint): the newest whole checkpoint in `out`, or that there is none."""
    from bigbatch.train.checkpoint import latest_checkpoint

    try:
        path = latest_checkpoint(out, warn=False)
    except OSError:
        path = None
    if path is None:
        return "no checkpoint was written: a new run starts from the beginning"
    return f"the newest checkpoint written is {path}: continue from it with --resume"


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handlers(handler: Any) -> Iterator[None]:
    """`handler` for SIGNALS during the block (main thread only: elsewhere Python cannot)."""
    if not _in_main_thread():
        yield
        return
    before = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _abort(signum: int, frame: Any) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


@contextlib.contextmanager
def abort_on_signals() -> Iterator[None]:
    """SIGTERM / SIGHUP raise `Stopped` at once during the block (SIGINT: KeyboardInterrupt)."""
    with _handlers(_abort):
        yield


class StopSignals:
    """The first signal of SIGNALS asks the run to stop after the current step.

    `poll()` is collective: every worker calls it once per step, at the same point.
    """

    def __init__(self, world: Any):
        self.world = world
        self.requested: int | None = None
        self._flag = torch.zeros(1, dtype=torch.int64, device=world.device)
        self._writing, self._interrupted = 0, False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            if self._writing:  # not inside a write: torch.save would tear the file
                self._interrupted = True
                return
            raise KeyboardInterrupt  # asked twice: at once
        if self.requested is None:
            self.requested = signum
            if self.world.rank == 0:  # said at once, past the progress bar's buffer
                again = " (Ctrl-C again: at once)" if signum == signal.SIGINT else ""
                os.write(2, f"\nbigbatch: {signal.Signals(signum).name}: stopping after this "
                            f"step, with a checkpoint{again}\n".encode())

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A checkpoint is being written: a second Ctrl-C during the block interrupts
        when it ends (torch.save turns an exception raised inside its write into a torn
        file and a misleading error), so what was being saved is saved whole."""
        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1
        if self._interrupted and not self._writing:
            self._interrupted = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handle SIGNALS during the block (the previous handlers come back after)."""
        with _handlers(self._handle):
            yield self

    def poll(self) -> int | None:
        """The signal every worker stops for (the largest number any worker received),
        or None to go on."""
        if not self.world.is_distributed:
            return self.requested
        self._flag.fill_(self.requested or 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return int(self._flag.item()) or None
