"""The ``straggler`` policy: find a worker that computes slower than the others, and act.

Every `[straggler] interval_steps` optimizer steps, the data-parallel workers
all-gather their mean compute, data-wait and sync-wait seconds per step over the
window (`bigbatch.engine.step_timing`; four scalars each). Rank 0 records them
as a ``ranks`` line in `metrics.jsonl`. A rank whose compute time exceeds
`threshold` times the median of the other ranks' for `patience` windows in a row
is flagged (`bigbatch.adaptive.straggler`): one log line
``straggler: rank N (host H) ...``, a ``straggler`` line in the metrics, and the
`action`:

- ``warn``: nothing more;
- ``rebalance``: every rank's micro batch becomes proportional to its measured
  speed (`run.micro_batch_sizes`; the global batch stays). The loader hands out
  those sizes, and the gradient average is weighted by samples, so each step is
  still exactly the big-batch step. Flags are counted afresh after a change, so
  the shares follow a load that moves;
- ``stop``: the run checkpoints and ends with status `EXIT_STRAGGLER` (75), so a
  scheduler can restart it without that node.

Every rank sees the same gathered numbers and so takes the same decision. It
needs plain data parallelism (DDP), where the wait for others can be told apart.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.adaptive.policy import Policy
from bigbatch.adaptive.straggler import EXIT_STRAGGLER, StragglerDetector, rebalance
from bigbatch.engine.step_timing import StepTiming

__all__ = ["EXIT_STRAGGLER", "Straggler"]

log = logging.getLogger("bigbatch.straggler")


class Straggler(Policy):
    """Built-in policy ``straggler``, set by `[straggler]` (`StragglerConfig`)."""

    name = "straggler"

    def __init__(self, interval_steps: int = 20, threshold: float = 1.5, patience: int = 3,
                 action: str = "warn", max_micro_factor: float = 2.0) -> None:
        self.interval_steps = int(interval_steps)
        self.action = action
        self.max_micro_factor = float(max_micro_factor)
        self.detector = StragglerDetector(threshold, patience)
        self.timing = StepTiming()
        self.flags: list[dict[str, Any]] = []
        """Every flag so far: step, rank, host, ratio, action."""
        self.hosts: list[str] | None = None
        self._recent: deque[list[float]] = deque(maxlen=self.detector.patience)

    @classmethod
    def from_strategy(cls, strategy: Any) -> Straggler:
        c = strategy.straggler
        return cls(c.interval_steps, c.threshold, c.patience, c.action, c.max_micro_factor)

    def setup(self, run: Any) -> None:
        if run.mesh.data_degree > 1:
            self.timing.install(run)

    def after_step(self, run: Any, stats: dict[str, float]) -> None:
        if run.mesh.data_degree < 2:
            return
        self.timing.step_done(run.last_step_seconds)
        if run.step % self.interval_steps == 0:
            self._window(run)

    def _window(self, run: Any) -> None:
        t0 = time.perf_counter()
        c, d, s, n = self.timing.take()
        group, W = run.mesh.dp_group, run.mesh.data_degree
        mine = torch.tensor([c, d, s, float(n)], dtype=torch.float64)
        rows = [torch.zeros_like(mine) for _ in range(W)]
        dist.all_gather(rows, mine, group=group)
        if self.hosts is None:
            hosts: list[Any] = [None] * W
            dist.all_gather_object(hosts, socket.gethostname(), group=group)
            self.hosts = [str(h) for h in hosts]
        self.timing.add_sync(time.perf_counter() - t0)
        table = torch.stack(rows)
        steps = table[:, 3].clamp_min(1)
        compute, data, sync = ((table[:, i] / steps).tolist() for i in range(3))
        shares = list(run.micro_batch_sizes or [run.plan.micro_batch_size] * W)
        policies = run.policies
        policies.record({"kind": "ranks", "step": run.step, "compute_s": compute,
                         "data_s": data, "sync_s": sync, "micro_batch_sizes": shares})
        self._recent.append(compute)
        for r in self.detector.update(compute):
            self._flag(run, r, compute)
        if self.action == "rebalance" and self.detector.slow:
            # Speeds from the windows that made the flag, not the last one alone: less noise.
            mean = [sum(col) / len(col) for col in zip(*self._recent, strict=True)]
            self._rebalance(run, shares, mean)

    def _flag(self, run: Any, rank: int, compute: list[float]) -> None:
        ratio = self.detector.last_ratios[rank]
        host = self.hosts[rank] if self.hosts else "?"
        others = sorted(c for q, c in enumerate(compute) if q != rank)
        median = others[len(others) // 2] if len(others) % 2 else sum(
            others[len(others) // 2 - 1:len(others) // 2 + 1]) / 2
        windows = self.detector.patience
        line = (f"straggler: rank {rank} (host {host}) computes {ratio:.2f}x the median of the "
                f"other ranks ({1e3 * compute[rank]:.1f} ms vs {1e3 * median:.1f} ms per step) "
                f"for {windows} window{'s' if windows > 1 else ''} of {self.interval_steps} "
                f"steps; action {self.action}")
        entry = {"step": run.step, "rank": rank, "host": host, "ratio": ratio,
                 "compute_s": compute[rank], "median_others_s": median, "action": self.action}
        self.flags.append(entry)
        run.policies.record({"kind": "straggler", **entry})
        if run.world.is_main and self.action != "stop":  # a stop prints the line itself
            log.warning(line)
        if self.action == "stop":
            run.policies.request_stop(f"{line}: stopped after a checkpoint (exit status "
                                      f"{EXIT_STRAGGLER})", EXIT_STRAGGLER)

    def _rebalance(self, run: Any, shares: list[int], compute: list[float]) -> None:
        new = rebalance(shares, compute, self.max_micro_factor)
        self.detector.reset()
        self._recent.clear()
        if new == shares:
            return
        even = all(x == new[0] for x in new)
        run.micro_batch_sizes = None if even else new
        run.policies.record({"kind": "rebalance", "step": run.step, "old": shares, "new": new})
        if run.world.is_main:
            log.warning("straggler: micro batches per rank %s -> %s (global batch %d kept)",
                        shares, new, run.plan.global_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict(), "flags": [dict(f) for f in self.flags]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["detector"])
        self.flags = [dict(f) for f in state.get("flags", [])]
