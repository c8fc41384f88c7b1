"""Which ranks did not answer, after a collective failed.

Neither gloo nor NCCL says which peer a timed-out collective waited for. torchrun's
agent holds a store that outlives any worker (its MASTER_ADDR:MASTER_PORT when
TORCHELASTIC_USE_AGENT_STORE is set): each worker leaves its host there when it joins
(`announce`), and every worker that sees a collective fail posts its rank and waits a
few seconds for the others (`roll_call`). The ones that never post are hung, stopped or
gone; they are the ranks to name. Without an agent store there is nobody to ask (None).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from typing import Any

__all__ = ["ROLL_CALL_S", "agent_store", "announce", "failed_in", "roll_call"]

ROLL_CALL_S = 2.0
"""Seconds a failed worker waits for the others to post theirs: the ranks of one
collective time out within a step of each other."""
_STORE_S = 5.0


def agent_store(timeout: datetime.timedelta) -> Any:
    """A client of torchrun's agent store, its keys this restart attempt's own, or None
    without one (`env://`, or no torchrun)."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"bigbatch/attempt_{attempt}/", store)


def announce(store: Any, rank: int) -> None:
    """Leave this worker's host name in `store` (the agent store), for a roll call to name."""
    if store is not None:
        store.set(f"roll_call/host/{rank}", socket.gethostname())


def roll_call(rank: int, world_size: int, wait_s: float = ROLL_CALL_S
              ) -> list[tuple[int, str | None]] | None:
    """Post that this rank saw a collective fail; wait up to `wait_s` for every other rank
    to post; return the ones that did not, with their hosts where known (None: no agent
    store, or it did not answer)."""
    import torch.distributed as dist

    try:
        store = agent_store(datetime.timedelta(seconds=_STORE_S))
        if store is None:
            return None
        store.set(f"roll_call/failed/{rank}", "1")
        missing = [r for r in range(world_size) if r != rank]
        deadline = time.monotonic() + wait_s
        while missing:
            missing = [r for r in missing if not store.check([f"roll_call/failed/{r}"])]
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        hosts = []
        for r in missing:
            key = f"roll_call/host/{r}"
            hosts.append((r, store.get(key).decode() if store.check([key]) else None))
        return hosts
    except (RuntimeError, ValueError, OSError, dist.DistError):
        return None


_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def failed_in(exc: BaseException) -> str | None:
    """The collective `exc` came out of, where the traceback or the message says: the torch
    function called (`all_reduce`, `barrier`, `init_process_group`), NCCL's OpType, or the
    gradient reduction inside `backward`."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in frames:
        if frame.filename.endswith(_C10D) and not frame.name.startswith("_"):
            return frame.name
    text = str(exc)
    if "OpType=" in text:
        return text.split("OpType=", 1)[1].split(",", 1)[0].split(")", 1)[0].lower()
    if any(f.name == "backward" and os.sep + "torch" + os.sep in f.filename for f in frames):
        return "backward (the gradient reduction)"
    return None
