"""One failure line per job, not one per rank.

A worker of `bigbatch train --nproc N` does not print its failure line: it writes it to
the error file torchrun's agent gives every worker (TORCHELASTIC_ERROR_FILE, read back
as `ProcessFailure.message`) and exits. Once the agent has ended the whole group, the
launcher (`bigbatch.cli.launch`) picks one line from all ranks and prints it: a worker
killed by a signal before anyone failed, else the first failure that is not about a
peer (a non-finite loss every rank saw alike, out of memory), else a peer timeout that
names the ranks that never answered (`bigbatch.parallel.roll_call`), else any peer
timeout. Outside bigbatch's launcher (plain torchrun, a single process), and where the
agent restarts the group after the failure (`--max-restarts`), a worker prints its own
line (a peer timeout: only the lowest rank that saw it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

__all__ = ["ERROR", "PEER", "PEER_NAMED", "choose", "fail", "out_of_memory"]

ERROR, PEER_NAMED, PEER = 0, 1, 2
"""A report's rank in the choice: the failure itself; a peer timeout naming who did not
answer; a peer timeout that cannot say who."""
_KEY = "bigbatch_failure"
LAUNCHER_ENV = "BIGBATCH_LAUNCHER_PID"
"""Set by bigbatch's launcher in its workers' environment (its pid): they report to it."""


def _to_launcher() -> str | None:
    """The error file to write, in a worker that bigbatch's own launcher started."""
    if LAUNCHER_ENV in os.environ and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return os.environ["TORCHELASTIC_ERROR_FILE"]
    return None


def _restart_follows() -> bool:
    """True in a torchrun worker whose failure makes the agent restart the group: the
    launcher then never hears of it, and the worker says it itself."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return count.isdigit() and most.isdigit() and int(count) < int(most)


def fail(line: str, status: int = 1, kind: int = ERROR, speaks: bool = True) -> int:
    """End this process's part of a failed run with `line`: handed to bigbatch's launcher
    in one of its workers, else printed on stderr (`speaks=False`: not printed, another
    rank prints the same). Returns `status`."""
    path = None if _restart_follows() else _to_launcher()
    if path is not None:
        now = time.time()
        report = {_KEY: {"line": line, "status": status, "kind": kind, "time": now}}
        try:
            with open(path, "w") as f:  # torchrun's own format: a message and a timestamp
                json.dump({"message": json.dumps(report), "timestamp": int(now)}, f)
            return status
        except OSError:
            pass
    if speaks:
        print(line, file=sys.stderr)
    return status


def _report(failure: Any) -> dict | None:
    try:
        found = json.loads(failure.message)
    except (TypeError, ValueError):
        return None
    return found.get(_KEY) if isinstance(found, dict) else None


def choose(failures: dict[int, Any]) -> tuple[str | None, int, int | None]:
    """From torchrun's failures (global rank -> ProcessFailure): the line to print (None:
    the worker printed its own, e.g. a traceback), the exit status, and the rank a signal
    killed first when that is the story."""
    reports, deaths = {}, {}
    for rank, failure in failures.items():
        found = _report(failure)
        if found is not None:
            reports[rank] = found
        elif failure.exitcode < 0:
            deaths[rank] = failure
    first_report = min((r["time"] for r in reports.values()), default=float("inf"))
    # torchrun stamps a death in whole seconds when it collects it, and it ends the
    # survivors of a death with SIGTERM in the same second: a tie goes to another signal
    # (the rank killed first), then to the lowest rank.
    first_death = min(deaths.items(), key=lambda kv: (
        kv[1].timestamp, kv[1].exitcode == -signal.SIGTERM, kv[0]), default=None)
    before = int(first_report) if reports else first_report  # whole seconds, as torchrun's
    if first_death is not None and first_death[1].timestamp <= before:
        return None, 1, first_death[0]  # a worker died first: the others only lost it
    if reports:
        best = min(reports.items(), key=lambda kv: (kv[1]["kind"], kv[1]["time"], kv[0]))[1]
        return best["line"], int(best["status"]), None
    exits = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    return None, exits[0][1].exitcode if exits else 1, None


_CPU_OOM = "DefaultCPUAllocator: can't allocate memory"


def out_of_memory(exc: BaseException, strategy: Any, world_size: int) -> str | None:
    """The line for running out of memory (torch.OutOfMemoryError, or the CPU allocator's
    RuntimeError): the micro batch that did not fit and what to lower; None otherwise."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        where = "GPU"
    elif _CPU_OOM in str(exc):
        where = "CPU"
    else:
        return None
    head = f"out of {where} memory"
    try:
        plan = strategy.ceiling(world_size)
    except Exception:  # the strategy is not what failed: say what we can
        plan = None
    if plan is None:
        return (f"{head}: lower batch.micro_batch_size, or save memory with --set "
                "recompute.enable=true or --set sharding.stage=2 (ZeRO)")
    m, k = plan.micro_batch_size, plan.k_steps
    keep = (f"--set batch.micro_batch_size={m // 2} --set gradient_merge.k_steps={2 * k} "
            f"keeps the global batch {plan.global_batch_size}") if m > 1 else (
        "the micro batch is 1 already")
    return (f"{head} at micro batch size {m} per worker (global batch "
            f"{plan.global_batch_size} = {m} x k_steps {k} x {plan.world_size} workers): "
            f"{keep}; or save memory with --set recompute.enable=true or --set "
            "sharding.stage=2 (ZeRO)")
