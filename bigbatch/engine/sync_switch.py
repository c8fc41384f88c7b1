"""The ``sync_switch`` policy: local SGD while communication dominates a step, all-reduce
otherwise (KungFu's adaptive synchronisation, Mai et al., OSDI 2020).

Every `[sync_switch] window_steps` optimizer steps each worker measures the share of
a step that communication takes:

- under all-reduce: the sync wait per step over (sync wait + compute) per step
  (`bigbatch.engine.step_timing`: from the last gradient ready to the end of backward);
- under local SGD: the time of one model average (a model-sized all-reduce, timed
  after a barrier) over (that + compute per step), i.e. what the share would be if the
  workers all-reduced every step again. A window without an average decides nothing.

The workers take the minimum of their shares (one all-reduce of one float): the last
worker to reach a collective waits only for the transfer, so a slow worker is not
mistaken for a slow network. Above `threshold` the run moves to local SGD with an
average every `k_steps` steps; under it, back to all-reduce (the models averaged
first). Both moves are exact in place at a step boundary
(`bigbatch.parallel.switchable_reduce`).

Each switch is a ``sync_switch`` line in `metrics.jsonl` (step, old and new mode,
the measured share, the threshold), a log line, and an event in `bigbatch monitor`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.adaptive.policy import Policy
from bigbatch.engine.step_timing import StepTiming
from bigbatch.errors import ConfigError

__all__ = ["SyncSwitch", "comm_fraction"]

log = logging.getLogger("bigbatch.adaptive")


def comm_fraction(comm_s: float, compute_s: float) -> float:
    """Share of a step spent communicating, from seconds per step (0 when both are 0)."""
    total = comm_s + compute_s
    return comm_s / total if total > 0 else 0.0


class SyncSwitch(Policy):
    """Built-in policy ``sync_switch``, set by `[sync_switch]` (`SyncSwitchConfig`)."""

    name = "sync_switch"

    def __init__(self, threshold: float = 0.5, window_steps: int = 20) -> None:
        self.threshold = float(threshold)
        self.window_steps = int(window_steps)
        self.timing = StepTiming()
        self.reduce: Any = None
        self.switches: list[dict[str, Any]] = []
        """Every switch so far: step, old, new, comm_fraction."""

    @classmethod
    def from_strategy(cls, strategy: Any) -> SyncSwitch:
        c = strategy.sync_switch
        return cls(c.threshold, c.window_steps)

    def setup(self, run: Any) -> None:
        if run.mesh.data_degree < 2:
            return  # one worker: nothing to synchronise
        from bigbatch.parallel.switchable_reduce import SwitchableReduce

        if not isinstance(run.local_sgd, SwitchableReduce):
            raise ConfigError('adaptive.policies = ["sync_switch"] needs the run prepared '
                              "with it in the strategy (plain data parallelism, DDP)")
        self.reduce = run.local_sgd
        self.timing.install(run)

    def after_step(self, run: Any, stats: dict[str, float]) -> None:
        if self.reduce is None:
            return
        self.timing.step_done(run.last_step_seconds)
        if run.step % self.window_steps == 0:
            self._decide(run)

    def _decide(self, run: Any) -> None:
        compute, _data, sync, steps = self.timing.take()
        avg_s, averages = self.reduce.take_average_time()
        local = self.reduce.mode == "local"
        if steps == 0 or (local and averages == 0):
            return
        comm = avg_s / averages if local else sync / steps
        mine = torch.tensor([comm_fraction(comm, compute / steps)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=run.mesh.dp_group)
        share = float(mine)
        if local == (share > self.threshold):
            return
        old = self.reduce.mode
        if local:
            self.reduce.to_allreduce()
        else:
            self.reduce.to_local()
        new = self.reduce.mode
        what = ("model averaging every "
                f"{self.reduce.k_steps} steps" if new == "local" else "all-reduce every step")
        reason = (f"communication {share:.0%} of a step {'>' if new == 'local' else '<='} "
                  f"threshold {self.threshold:.0%}: {what}")
        entry = {"step": run.step, "old": old, "new": new, "comm_fraction": share,
                 "threshold": self.threshold, "reason": reason}
        self.switches.append(entry)
        run.policies.record({"kind": "sync_switch", **entry})
        if run.world.is_main:
            log.info("step %d: synchronisation %s -> %s (%s)", run.step, old, new, reason)

    def state_dict(self) -> dict[str, Any]:
        return {"switches": [dict(s) for s in self.switches]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.switches = [dict(s) for s in state.get("switches", [])]
