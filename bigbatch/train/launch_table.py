"""The launch table: who runs where, gathered once at the start of a run (Fleet's
"Distributed Envs" and fleetrun's "Configuration Arguments": trainer id, endpoints, trainer
count, selected devices). The run's header shows it and `run.json` keeps it as ``launch``.

Each rank reports what it can see: its rank, local rank, node (torchrun's GROUP_RANK),
host name, process id and device. torchrun gives workers no port of their own (gloo and
NCCL pick theirs); the endpoint every rank meets at is the rendezvous store's,
MASTER_ADDR:MASTER_PORT, shown once with the world size and the restart count.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from bigbatch.parallel.world import World, gather

__all__ = ["gather_launch", "launch_lines", "rank_entry"]

COLUMNS = ("rank", "local_rank", "node", "host", "pid", "device")


def _device(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def rank_entry(world: World) -> dict[str, str]:
    """This rank's row (all strings)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    device = _device(world.device)
    if visible is not None and world.device.type == "cuda":
        device += f", CUDA_VISIBLE_DEVICES={visible}"
    return {"rank": str(world.rank), "local_rank": str(world.local_rank),
            "node": os.environ.get("GROUP_RANK", "0"), "host": socket.gethostname(),
            "pid": str(os.getpid()), "device": device}


def gather_launch(world: World) -> dict[str, Any]:
    """Collective (every rank calls it once): the job's table, by rank, on every rank."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return {
        "world_size": world.world_size,
        "endpoint": f"{addr}:{port}" if addr and port else None,
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "ranks": gather(rank_entry(world), world),
    }


def launch_lines(launch: dict[str, Any]) -> list[str]:
    """The table as the header prints it: a title line, then one row per rank."""
    where = launch["endpoint"] or "none (one process)"
    title = (f"launch: world size {launch['world_size']}, rendezvous endpoint {where}"
             + (f", restart {launch['restart']}" if launch["restart"] else ""))
    rows = [[r[c] for c in COLUMNS] for r in launch["ranks"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(COLUMNS)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [title, "  " + fmt.format(*COLUMNS).rstrip(),
            *("  " + fmt.format(*row).rstrip() for row in rows)]
