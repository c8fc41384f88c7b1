"""Where this process sits in the job, and the process group's life cycle.

`World` is read from the environment `torchrun` sets (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Without torchrun the world is one
process on one device and needs no process group at all: that path is first
class, not a degenerate case of the distributed one.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.errors import ConfigError

__all__ = ["World", "all_reduce_sum", "init_distributed", "is_peer_failure", "resolve_backend",
           "teardown"]

BACKENDS = ("auto", "gloo", "nccl")


def _env_int(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r}: expected an integer >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"environment {name}={value}: expected an integer >= {minimum}")
    return value


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass(frozen=True)
class World:
    """This process's place in the job: its rank among all workers and its device."""

    rank: int = 0
    """Global rank of this worker, 0 <= rank < world_size."""
    world_size: int = 1
    """Number of data-parallel workers (processes)."""
    local_rank: int = 0
    """Rank of this worker on its machine; picks the GPU."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Device the model and its gradients live on."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size}: expected >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank}: expected 0 <= rank < world_size={self.world_size}")
        if self.local_rank < 0:
            raise ConfigError(f"local_rank={self.local_rank}: expected >= 0")

    @classmethod
    def from_env(cls, device: torch.device | str | None = None) -> World:
        """Read the torchrun environment; absent variables mean a single process.

        `device` overrides the default (cuda:LOCAL_RANK when CUDA is present, else cpu).
        """
        world_size = _env_int("WORLD_SIZE", 1, minimum=1)
        rank = _env_int("RANK", 0)
        local_rank = _env_int("LOCAL_RANK", rank if world_size > 1 else 0)
        dev = torch.device(device) if device is not None else _default_device(local_rank)
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)

    @property
    def is_distributed(self) -> bool:
        """True when there is more than one worker (a process group is needed)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the worker that logs and writes checkpoints."""
        return self.rank == 0


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto` means NCCL for CUDA devices and gloo otherwise."""
    if backend not in BACKENDS:
        raise ConfigError(f"data_parallel.backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"data_parallel.backend='nccl' needs CUDA devices; this worker runs on {device.type}")
    return backend


def init_distributed(config: Any = None, world: World | None = None) -> World:
    """Join the process group described by the torchrun environment, if there is one.

    `config` is a `DataParallelConfig` (or anything with `backend` and `timeout_s`);
    None means backend auto and a 300 s timeout. World size 1 creates no group.
    Idempotent: an existing default group is reused when its size matches.
    Returns the world this process belongs to.
    """
    world = world if world is not None else World.from_env()
    if not world.is_distributed:
        return world
    if dist.is_initialized():
        if dist.get_world_size() != world.world_size or dist.get_rank() != world.rank:
            raise ConfigError(
                f"process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the world says rank {world.rank} of {world.world_size}"
            )
        return world
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ConfigError(f"environment {name} is not set: launch multi-worker jobs with torchrun")
    backend = resolve_backend(getattr(config, "backend", "auto"), world.device)
    timeout_s = float(getattr(config, "timeout_s", 300.0))
    if timeout_s <= 0:
        raise ConfigError(f"data_parallel.timeout_s={timeout_s}: expected > 0")
    kwargs: dict[str, Any] = {}
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
        # Binding the group to the device lets NCCL connect eagerly and fail early.
        kwargs["device_id"] = world.device
    timeout = datetime.timedelta(seconds=timeout_s)
    from bigbatch.parallel.roll_call import agent_store, announce

    attempt = agent_store(timeout)
    base = attempt if attempt is not None else _job_store(world, timeout)
    global _GROUPS_MADE
    store = dist.PrefixStore(f"bigbatch/group_{_GROUPS_MADE}/", base)
    _GROUPS_MADE += 1
    dist.init_process_group(backend=backend, rank=world.rank, world_size=world.world_size,
                            timeout=timeout, store=store, **kwargs)
    announce(attempt, world.rank)  # for a roll call to name this rank's host
    return world


_GROUPS_MADE = 0
"""Default groups this process has made: the same count on every rank of an SPMD program."""
_JOB_STORES: dict[tuple[str, int, int, int], Any] = {}


def _job_store(world: World, timeout: datetime.timedelta) -> Any:
    """The TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 serves it), kept for the process.

    A job that destroys its group and makes another (`run.close()`, then `prepare()`
    again) meets on the same port. Had each group its own store, as `env://` gives,
    a fast rank could reach rank 0's old store before rank 0 closed it, read the old
    group's gloo addresses, and leave rank 0 waiting forever in the new group's connect.
    One store per job, and keys per group (`init_distributed`'s prefix), rule that out,
    as torchrun's agent store does for its workers (whose keys are prefixed by restart
    attempt: the dead attempt's addresses are never read).
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    key = (addr, port, world.world_size, world.rank)
    if key not in _JOB_STORES:
        _JOB_STORES[key] = dist.TCPStore(addr, port, world.world_size,
                                         is_master=world.rank == 0, timeout=timeout,
                                         multi_tenant=True)
    return _JOB_STORES[key]


def teardown() -> None:
    """Leave and destroy the default process group; a no-op when there is none.

    What is left unreachable first goes while the group exists (`gc.collect`): a DDP
    reducer freed after the group's destruction takes the last reference to the gloo
    group with it, at the interpreter's exit, where gloo's threads abort the process
    ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, async_op: bool = False, group: Any = None) -> Any:
    """Sum `tensor` over all workers (or `group`) in place; a no-op without a process group.

    Returns the work handle when `async_op`, else None.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op, group=group)


# What gloo, NCCL and the TCPStore say when a peer is gone or does not answer in time.
_PEER_FAILURE_TEXT = ("timed out", "timeout", "connection reset by peer",
                      "connection closed by peer", "connection refused", "broken pipe")


def is_peer_failure(exc: BaseException) -> bool:
    """True for the errors of a collective or rendezvous whose peer died or hung."""
    if isinstance(exc, dist.DistError) and not isinstance(exc, dist.DistStoreError):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, dist.DistError)) and any(
        t in text for t in _PEER_FAILURE_TEXT)


# ---------------------------------------------------------------- small collectives


def barrier(world: World) -> None:
    if world.is_distributed and dist.is_initialized():
        dist.barrier()


def broadcast(obj: Any, world: World) -> Any:
    """Rank 0's `obj` on every worker."""
    if not world.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any, world: World) -> list[Any]:
    """Every worker's `obj`, by rank, on every worker."""
    if not world.is_distributed:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def sync_buffers(module: torch.nn.Module, world: World, group: Any = None) -> None:
    """Give every worker of `group` (default: all) its first rank's buffers (BatchNorm
    statistics); a pipeline passes its data-parallel group, whose ranks hold one stage.

    They drift apart between DDP's per-forward broadcasts; evaluating and saving
    rank 0's is what the next forward would do anyway.
    """
    if world.is_distributed:
        for buf in module.buffers():
            dist.broadcast(buf, group=group, group_src=0)


def summed(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """`t` summed over all workers (or `group`), in place (an evaluation `reduce`)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
