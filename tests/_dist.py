"""Run a function in N CPU processes joined by a gloo group on 127.0.0.1.

    results = run_workers(fn, world_size=2, args=(...), timeout=60)

`fn(*args)` runs in each worker process with the test's environment plus torchrun's
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), the test's stdout and
stderr, and one intra-op thread. The workers are forks of one fork server per test
session that has imported torch and bigbatch's engine and trainer (`PRELOAD`), so
they start in a fraction of a second instead of importing torch each time.
Whoever needs the group creates it (`bigbatch.parallel.world.init_distributed` or
`bigbatch.engine.prepare`), or pass `init_group=True` to have it made here.
Each process's return value comes back through `torch.save` files (tensors
included), ordered by rank. A failure in any process raises with its
traceback; a hang is killed after `timeout` seconds.

`fn` must be importable by name (a module-level function of a test module).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stdio:
    """The test process's stdout and stderr as they are at the start (pytest's capture,
    or capfd's), handed to the child: a fork server's child would otherwise write where
    the server does."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _take_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _take_stdio(out: Any, err: Any) -> None:
    """In the child, while its arguments are unpickled: fds 1 and 2 become the parent's."""
    for fd, wrapper in ((1, out), (2, err)):
        received = wrapper.detach()
        os.dup2(received, fd)
        os.close(received)


def _child(fn: Callable, args: tuple, rank: int, world_size: int, port: int, out_dir: str,
           init_group: bool, environ: dict[str, str], stdio: None) -> None:
    # A fork of the fork server has the environment the server started with: take the
    # test's own, as a spawned process would.
    os.environ.clear()
    os.environ.update({k: v for k, v in environ.items()  # not a launcher's, from an earlier test
                       if not k.startswith(("TORCHELASTIC_", "BIGBATCH_LAUNCHER"))})
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    # gloo's own sockets on loopback too (as bigbatch's launcher sets for a single-node
    # job): left to the host name, a 2-rank TP group was seen to hang in gloo's connect
    # under pytest (tests/test_own_loop_data).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import torch.distributed as dist

    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(*args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        # What `fn` left behind goes while the group still exists. A DDP reducer holds the
        # gloo group; when it holds the last reference, freeing it destroys the group with
        # the GIL held, and the group's destructor can wait forever on a gloo thread that
        # itself waits for the GIL (a hang after all the work is done).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


# Workers are forks of one fork server that has imported torch and bigbatch's engine and
# trainer once: a fresh interpreter importing them costs a few seconds of CPU per worker,
# about 8 s of wall time for two workers on two shared cores, which most of these tests
# would otherwise spend on every spawn. The server never runs an op or makes a group, so
# each fork starts as a spawned process would after those imports.
PRELOAD = ["torch", "torch.distributed", "bigbatch.engine.prepare", "bigbatch.train.trainer"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_workers(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 60.0,
                init_group: bool = False,
                on_start: Callable[[list[Any]], None] | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo workers; return their results by rank.

    `on_start(processes)` runs once they are started (e.g. to signal one of them)."""
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_child, args=(fn, args, r, world_size, port, out_dir, init_group,
                                          dict(os.environ), _Stdio()))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        if on_start is not None:
            on_start(procs)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                continue
            got = torch.load(path, weights_only=False)
            if got["ok"]:
                results.append(got["result"])
            else:
                errors.append(f"rank {r}:\n{got['error']}")
        if hung:
            errors.insert(0, f"ranks {hung} still running after {timeout:.0f} s: killed")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results


class CountCalls:
    """Counts calls to the named functions of `torch.distributed` and of its functional
    collectives while active: `with CountCalls(("all_reduce",)) as c: ...; c.calls`."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.calls = 0

    def __enter__(self) -> CountCalls:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self.saved = [(m, n, getattr(m, n)) for m in (dist, funcol) for n in self.names
                      if hasattr(m, n)]
        for mod, name, fn in self.saved:
            setattr(mod, name, self._wrap(fn))
        return self

    def _wrap(self, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc: Any) -> None:
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)
