"""A parameter server on torch.distributed.rpc (Li et al. 2014; Fleet's PS modes).

Ranks 0..S-1 are servers: each owns whole parameter tensors (spread over the servers
by size) and applies the optimizer to them. The other ranks are workers: they pull the
parameters, compute a gradient on their batch and push each server its part.

- sync: a server steps once every worker's gradient of a version is in, on their mean
  (each divided by W, summed in worker order: DDP's arithmetic, so the weights equal
  data parallelism's), and then every worker gets the new parameters.
- async: a server applies each gradient as it arrives. A gradient computed on
  parameters more than `max_staleness` versions old is dropped and counted; the
  staleness of every applied one is kept as a histogram. A worker waits for its push's
  reply and computes on the parameters it brings: Paddle's half-async trainer (whose
  CPU_NUM threads' summed gradients are a merge with avg = false), not Paddle's async
  one, which goes on while background threads send and pull.
- geo (Fleet's GEO-SGD): each worker steps its own copy of the model with the
  optimizer for k steps, then pushes a delta per tensor, d = (x - old) / W, where `old`
  is what it last pulled, and moves `old` by d (`geo_delta`). A server waits for every
  worker's delta of the round and adds them to its tensors one by one in worker order
  (no optimizer on the server); each worker then takes the new values v and keeps what
  it did not send: x = v + (x - old), old = v (`geo_take`). This is the arithmetic of
  Paddle's GeoCommunicator (SendDense, RecvDense); Paddle's communicator does not wait
  for the other workers, bigbatch's round does, so the result does not depend on timing.

This module is the protocol only. The server's optimizer step is injected
(`Server.step_fn(grads, pushes)`; the main job runs the engine's step there), and on
server 0 every step's reply waits in `Server.events` until the caller releases it,
so logging, evaluation and checkpoints happen between steps.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc

__all__ = ["Push", "Reply", "Server", "Worker", "assign_shards", "geo_delta", "geo_take",
           "serve", "server_name", "start_rpc", "worker_name"]

_SERVER: Server | None = None  # this process's server, for the RPC entry points


def server_name(index: int) -> str:
    return f"ps{index}"


def worker_name(index: int) -> str:
    return f"worker{index}"


def assign_shards(sizes: Sequence[int], servers: int) -> list[int]:
    """The server of each tensor: largest first, each to the least loaded server."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += sizes[i]
    return owner


def start_rpc(rank: int, world_size: int, servers: int, timeout_s: float,
              init_method: str | None = None) -> str:
    """Join the RPC group under this rank's name (servers first, then workers);
    `init_method`: its rendezvous URL (default: torch's, env://)."""
    name = server_name(rank) if rank < servers else worker_name(rank - servers)
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout_s)
    if init_method is not None:
        options.init_method = init_method
    with warnings.catch_warnings():
        # TensorPipe's static-group set-up (torch 2.13, rpc/backend_registry.py) exchanges
        # device maps over a ProcessGroupGloo it builds itself, which c10d's object
        # collectives call a deprecated "Backend as a ProcessGroup": torch's own use, once
        # per rank, with no public alternative but dynamic membership (other shutdown rules).
        warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    return name


@dataclass
class Push:
    """One worker's gradient for one server."""

    worker: int
    version: int
    """The server version of the parameters the gradient was computed on."""
    grads: list[torch.Tensor]
    """Summed over the worker's micro-steps, for the server's tensors in its order."""
    count: float
    """Items behind the gradient (the engine's `count=`)."""
    loss: float
    """Summed loss over those items (for the log)."""
    extra: Any = None
    """What server 0 keeps from the worker: its resume state, worker 0's buffers."""


@dataclass
class Reply:
    version: int
    params: list[torch.Tensor]
    stop: bool
    applied: bool = True
    """async: False when the gradient was too stale and dropped."""


@dataclass
class Server:
    """One server rank's parameters, versions and bookkeeping."""

    index: int
    params: list[torch.Tensor]
    """The tensors this server owns (updated in place by `step_fn`)."""
    workers: int
    mode: str
    max_staleness: int
    step_fn: Callable[[list[torch.Tensor], list[Push]], None]
    """Apply one optimizer step: (gradient per owned tensor, the pushes behind it); geo
    calls it after adding the round's deltas, with no gradient ([])."""
    state_fn: Callable[[], Any] = lambda: None
    """This server's resumable state (its engine's state_dict), taken between steps."""
    gated: bool = False
    """Server 0: replies wait in `events` until released (between steps)."""
    is_done: Callable[[], bool] = lambda: False
    """True once no more steps may be applied (server 0: its schedule is over)."""
    version: int = 0
    stop: bool = False
    staleness: Counter = field(default_factory=Counter)
    dropped: int = 0
    events: queue.Queue = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _pending: dict[int, tuple[Push, torch.futures.Future]] = field(default_factory=dict)
    _waiting: list[tuple[int, torch.futures.Future, bool]] = field(default_factory=list)

    def _reply(self, applied: bool = True) -> Reply:
        return Reply(self.version, [p.detach().clone() for p in self.params], self.stop, applied)

    def push(self, p: Push) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self.lock:
            if self.stop or self.is_done():
                self.stop = True
                fut.set_result(self._reply(applied=False))
                return fut
            if self.mode in ("sync", "geo"):
                self._pending[p.worker] = (p, fut)
                if len(self._pending) < self.workers:
                    return fut
                pushes = [self._pending[w][0] for w in sorted(self._pending)]
                futs = [self._pending[w][1] for w in sorted(self._pending)]
                self._pending.clear()
                if self.mode == "sync":
                    self.step_fn(mean_gradient(pushes), pushes)
                else:
                    add_deltas(self.params, pushes)
                    self.step_fn([], pushes)
            else:
                staleness = self.version - p.version
                if staleness > self.max_staleness:
                    self.dropped += 1
                    fut.set_result(self._reply(applied=False))
                    return fut
                self.staleness[staleness] += 1
                pushes, futs = [p], [fut]
                self.step_fn(p.grads, pushes)
            self.version += 1
            self._wake()
            if not self.gated:
                self._release(futs)
            else:  # in version order, under the lock
                self.events.put((self.version, pushes, lambda: self._release(futs)))
        return fut

    def _release(self, futs: list[torch.futures.Future]) -> None:
        reply = self._reply()
        for f in futs:
            f.set_result(reply)

    def snapshot(self, min_version: int, with_state: bool) -> torch.futures.Future:
        """(params, state) once this server has reached `min_version` (sync checkpoints)."""
        fut: torch.futures.Future = torch.futures.Future()
        with self.lock:
            self._waiting.append((min_version, fut, with_state))
            self._wake()
        return fut

    def _wake(self) -> None:
        keep = []
        for min_version, fut, with_state in self._waiting:
            if self.version >= min_version or self.stop:
                fut.set_result(([p.detach().clone() for p in self.params],
                                self.state_fn() if with_state else None, self.version))
            else:
                keep.append((min_version, fut, with_state))
        self._waiting = keep

    def finish(self, at: int | None = None) -> bool:
        """No more steps: later pushes, and those waiting for a sync step that will not
        come (a worker is gone), get `stop` and are not applied. With `at`, only when no
        update was applied after version `at` (an async server stops on a step's
        boundary); returns whether it finished."""
        with self.lock:
            if at is not None and self.version != at:
                return False
            self.stop = True
            for _, fut in self._pending.values():
                fut.set_result(self._reply(applied=False))
            self._pending.clear()
            self._wake()
        return True


def mean_gradient(pushes: Sequence[Push]) -> list[torch.Tensor]:
    """sum over workers of g / W, in worker order: the arithmetic of DDP's mean."""
    w = len(pushes)
    out = [g / w for g in pushes[0].grads]
    for p in pushes[1:]:
        for acc, g in zip(out, p.grads, strict=True):
            acc.add_(g / w)
    return out


def add_deltas(params: Sequence[torch.Tensor], pushes: Sequence[Push]) -> None:
    """geo: each worker's delta added to the server's tensors, one worker after the other
    (as a Paddle server adds each delta it receives), in worker order."""
    with torch.no_grad():
        for p in pushes:
            torch._foreach_add_(list(params), p.grads)


def geo_delta(params: Sequence[torch.Tensor], old: Sequence[torch.Tensor],
              workers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A GEO worker's send: d = (x - old) / W per tensor, then old += d (in place).
    Returns (d, x - old): the deltas to push and the part of its progress the worker
    keeps (all of it but 1/W; nothing with one worker)."""
    scale = 1.0 / workers
    deltas = []
    with torch.no_grad():
        for x, o in zip(params, old, strict=True):
            d = (x.detach() - o) * scale
            o.add_(d)
            deltas.append(d)
        kept = [x.detach() - o for x, o in zip(params, old, strict=True)]
    return deltas, kept


def geo_take(params: Sequence[torch.Tensor], old: Sequence[torch.Tensor],
             values: Sequence[torch.Tensor], kept: Sequence[torch.Tensor]) -> None:
    """A GEO worker's pull: x = v + kept, old = v (in place), v the servers' values."""
    with torch.no_grad():
        for x, o, v, k in zip(params, old, values, kept, strict=True):
            x.copy_(v + k)
            o.copy_(v)


def serve(server: Server) -> None:
    """Make `server` the one this process's RPC entry points reach."""
    global _SERVER
    _SERVER = server


@rpc.functions.async_execution
def _push(p: Push) -> torch.futures.Future:
    return _SERVER.push(p)


def _pull() -> Reply:
    with _SERVER.lock:
        return _SERVER._reply()


@rpc.functions.async_execution
def _snapshot(min_version: int, with_state: bool) -> torch.futures.Future:
    return _SERVER.snapshot(min_version, with_state)


def fetch(server: int, min_version: int = 0, with_state: bool = False,
          timeout_s: float = 300.0) -> tuple[list[torch.Tensor], Any, int]:
    """A server's (params, state, version), from another rank or this one."""
    if _SERVER is not None and _SERVER.index == server:
        return _SERVER.snapshot(min_version, with_state).wait()
    return rpc.rpc_sync(server_name(server), _snapshot, args=(min_version, with_state),
                        timeout=timeout_s)


class Worker:
    """A worker's side: which server owns which tensor, and the versions it computed on."""

    def __init__(self, index: int, params: Sequence[torch.Tensor], owner: Sequence[int],
                 servers: int, timeout_s: float = 300.0) -> None:
        self.index = index
        self.params = list(params)
        self.by_server = [[i for i, s in enumerate(owner) if s == srv] for srv in range(servers)]
        self.versions = [0] * servers
        self.timeout_s = timeout_s
        self.old: list[torch.Tensor] = []
        """geo: the values this worker last pulled, moved by what it sent since."""

    def _take(self, server: int, reply: Reply) -> None:
        self.versions[server] = reply.version
        with torch.no_grad():
            for i, value in zip(self.by_server[server], reply.params, strict=True):
                self.params[i].copy_(value)

    def pull(self) -> None:
        """The servers' current parameters into this worker's model (geo: and `old`)."""
        for s in range(len(self.by_server)):
            self._take(s, rpc.rpc_sync(server_name(s), _pull, timeout=self.timeout_s))
        self.old = [p.detach().clone() for p in self.params]

    def keep(self, kept: Sequence[torch.Tensor]) -> None:
        """geo, on resume after `pull`: the progress this worker kept (x = pulled + kept)."""
        geo_take(self.params, self.old, [o.clone() for o in self.old], kept)

    def push_delta(self, workers: int, count: float, loss: float,
                   extra: dict[str, Any] | None = None) -> tuple[bool, list[bool]]:
        """geo: send each server the deltas of its tensors (`geo_delta`), take the new
        values back (`geo_take`). `extra` gets the kept progress as ``"geo_kept"`` (what a
        checkpoint needs to resume this worker). (stop, applied per server)."""
        deltas, kept = geo_delta(self.params, self.old, workers)
        if extra is not None:
            extra["geo_kept"] = kept
        futs = []
        for s, idx in enumerate(self.by_server):
            p = Push(self.index, self.versions[s], [deltas[i] for i in idx], count, loss,
                     extra if s == 0 else None)
            futs.append(rpc.rpc_async(server_name(s), _push, args=(p,), timeout=self.timeout_s))
        replies = [f.wait() for f in futs]
        for s, (reply, idx) in enumerate(zip(replies, self.by_server, strict=True)):
            self.versions[s] = reply.version
            if reply.applied:
                geo_take([self.params[i] for i in idx], [self.old[i] for i in idx],
                         reply.params, [kept[i] for i in idx])
        return any(r.stop for r in replies), [r.applied for r in replies]

    def push(self, grads: Sequence[torch.Tensor], count: float, loss: float,
             extra: Any = None) -> tuple[bool, list[bool]]:
        """Send each server its part; take back the parameters. (stop, applied per server)."""
        futs = []
        for s, idx in enumerate(self.by_server):
            p = Push(self.index, self.versions[s], [grads[i] for i in idx], count, loss,
                     extra if s == 0 else None)
            futs.append(rpc.rpc_async(server_name(s), _push, args=(p,), timeout=self.timeout_s))
        replies = [f.wait() for f in futs]
        for s, reply in enumerate(replies):
            self._take(s, reply)
        return any(r.stop for r in replies), [r.applied for r in replies]
