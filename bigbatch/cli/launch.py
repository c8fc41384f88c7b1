"""Launching workers through torchrun, and owning them.

`bigbatch train --nproc N` (and `bigbatch gns --nproc N`) runs torchrun's elastic
agent (`torch.distributed.run`) inside the `bigbatch` process rather than as a
child of it. A signal to `bigbatch` is then a signal to the agent, which passes
SIGTERM, SIGINT and SIGHUP on to every worker and waits for them (30 s, then
SIGKILL); the workers stop after their current step with a checkpoint
(`bigbatch.train.signals`). A failed worker hands its line to the launcher, which prints
one for the job (`bigbatch.cli.failure_report`). Each worker binds its life to the launcher with the
kernel's parent-death signal (`bind_to_launcher`), so a SIGKILL to `bigbatch` ends
them too. The exit status is the signal's (128 + n) or the first failed worker's.

Nothing listens beyond the machine unless the job spans machines: a c10d rendezvous
runs with its stores bound to one address (`bigbatch.cli.rendezvous`).

Rendezvous is bounded: torchrun gets `join_timeout` and `read_timeout` from
`--timeout`, and a watchdog ends a launcher whose workers have not started
within that plus `GRACE_S` (a `--rdzv-endpoint` on a port that another program
holds makes torch's store client wait without limit).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bigbatch.cli.failure_report import LAUNCHER_ENV
from bigbatch.errors import ConfigError

__all__ = ["GRACE_S", "LAUNCHER_ENV", "bind_to_launcher", "check_endpoint", "run_torchrun"]

GRACE_S = 5.0
"""Seconds past the rendezvous timeout before the watchdog ends a stuck launcher."""
_PR_SET_PDEATHSIG = 1
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def bind_to_launcher() -> None:
    """In a worker: receive SIGKILL when the process that started it dies (Linux), and end
    now if the `bigbatch` launcher that started it is already gone."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit() and os.getppid() != int(launcher):
        os._exit(1)  # orphaned before the death signal was armed


def check_endpoint(endpoint: str, timeout: float, several_nodes: bool = False) -> None:
    """`--rdzv-endpoint HOST:PORT` names a port and a host that resolves (within `timeout`);
    with `several_nodes`, a host *name* that resolves to loopback here is refused (the
    rendezvous store listens on that address: the other nodes could not reach it)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT with a port in "
                          "1..65535")
    found: list[BaseException | list[str]] = []

    def resolve() -> None:
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
            found.append([info[4][0] for info in infos])
        except OSError as e:
            found.append(e)

    t = threading.Thread(target=resolve, daemon=True)
    t.start()
    t.join(min(timeout, 30.0))
    if not found:
        raise ConfigError(f"--rdzv-endpoint {endpoint}: host {host} did not resolve within "
                          f"{min(timeout, 30.0):g} s")
    if isinstance(found[0], BaseException):
        why = getattr(found[0], "strerror", None) or found[0]
        raise ConfigError(f"--rdzv-endpoint {endpoint}: host {host} does not resolve ({why})")
    if several_nodes and _names_loopback(host.strip("[]"), found[0]):
        raise ConfigError(f"--rdzv-endpoint {endpoint}: {host} resolves to {found[0][0]} "
                          "(loopback) on this machine, where the rendezvous listens, and the "
                          "other nodes cannot reach it; give this machine's address on the "
                          f"network the nodes share, e.g. --rdzv-endpoint 10.0.0.1:{port}")


def _names_loopback(host: str, addresses: list[str]) -> bool:
    """True for a host name (not an address, not `localhost`) whose addresses are loopback:
    the `127.0.1.1 hostname` line of Debian's /etc/hosts."""
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        pass
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return False
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _has_children() -> bool | None:
    """Whether this process has child processes (None: /proc cannot say)."""
    try:
        tasks = list(Path("/proc/self/task").iterdir())
        return any((t / "children").read_text().strip() for t in tasks)
    except OSError:
        return None


class _Watchdog:
    """Until the workers start: ends the launcher (one line, `os._exit`) when the rendezvous
    outlasts `deadline_s`, or when a stop signal arrives while the main thread is stuck in
    a call that does not return to Python."""

    def __init__(self, deadline_s: float, command: str, what: str):
        self.deadline = time.monotonic() + deadline_s
        self.command, self.what = command, what
        self.done = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous_fd = -1

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._previous_fd = signal.set_wakeup_fd(self._write)
        thread = threading.Thread(target=self._watch, name="bigbatch-rendezvous", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self.done.set()
            signal.set_wakeup_fd(self._previous_fd)
            thread.join(2.0)
            for fd in (self._read, self._write):
                os.close(fd)

    def _end(self, message: str, status: int) -> None:
        print(f"bigbatch {self.command}: {message}", file=sys.stderr, flush=True)
        os._exit(status)

    def _watch(self) -> None:
        while not self.done.is_set():
            started = _has_children()
            if started is None or started:
                return  # the workers run: torchrun's handlers own the signals now
            ready, _, _ = select.select([self._read], [], [], 0.5)
            if ready and not self.done.is_set():
                signums = os.read(self._read, 64)
                if not self.done.wait(2.0) and not _has_children():  # main thread is stuck
                    from bigbatch.train.signals import exit_status

                    name = signal.Signals(signums[-1]).name
                    self._end(f"stopped by {name} before training started; nothing was "
                              "written", exit_status(signums[-1]))
            if time.monotonic() > self.deadline and not self.done.is_set():
                self._end(f"error: {self.what}", 1)


def _quiet_torchrun() -> None:
    """torchrun's warnings and its "failed (exitcode: 1)" report repeat what bigbatch says
    in one line: a failed worker printed why, and a killed one is named by `run_torchrun`
    (unless LOGLEVEL is set)."""
    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)


def run_torchrun(torchrun_argv: list[str], *, command: str, timeout: float,
                 endpoint: str | None = None, elastic_nodes: bool = False,
                 env: dict[str, str] | None = None) -> int:
    """Run torchrun's agent here with `torchrun_argv` (its flags, then the workers'
    command); returns the exit status. Prints one line for a failure no worker reported:
    a rendezvous that failed or timed out, a worker killed by a signal. `endpoint` (checked
    by the caller with `check_endpoint`) names the rendezvous in those lines."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousError,
        RendezvousTimeoutError,
    )

    from bigbatch.cli.rendezvous import bind_rendezvous
    from bigbatch.train.signals import exit_status

    args = torchrun.get_args_parser().parse_args(torchrun_argv)
    saved_environ = dict(os.environ)  # put back after the job: set for its workers only
    os.environ.update(env or {})
    for name, value in bind_rendezvous(args).items():  # the user's own setting wins
        os.environ.setdefault(name, value)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    if "LOGLEVEL" not in os.environ:  # c10d's C++ warnings repeat the one line we print
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    _quiet_torchrun()
    where = f" at {endpoint}" if endpoint else ""
    late = (f"rendezvous{where} did not complete within {timeout:g} s (--timeout); is another "
            "program on that port, or are the other nodes not up?")
    deadline = timeout + GRACE_S + (30.0 if elastic_nodes else 0.0)  # torchrun's last call
    watchdog = _Watchdog(deadline, command, late)
    handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}  # torchrun replaces them
    try:
        with watchdog.running():
            torchrun.run(args)
        return 0
    except SignalException as e:  # the workers stopped on it (and said so)
        return exit_status(e.sigval)
    except ChildFailedError as e:
        from bigbatch.cli.failure_report import choose

        line, status, killed = choose(e.failures)  # the workers handed their lines here
        if killed is not None:
            failure = e.failures[killed]
            if failure.exitcode == -signal.SIGABRT:  # torch's C++ gave up: its line is above
                line = (f"bigbatch {command}: error: worker rank {killed} aborted in torch "
                        "(SIGABRT; the line above says why): a collective that differs "
                        "between ranks, e.g. a parameter one rank does not use under "
                        "sharding.stage 2-3, or NCCL's watchdog after data_parallel.timeout_s")
            else:
                line = (f"bigbatch {command}: error: worker rank {killed} was killed by "
                        f"{failure.signal_name()}; continue from the last checkpoint with "
                        "--resume")
        if line is not None:
            print(line, file=sys.stderr)
        return status
    except RendezvousTimeoutError:
        print(f"bigbatch {command}: error: {late}", file=sys.stderr)
        return 1
    except RendezvousError as e:
        cause = e.__cause__ or e
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        print(f"bigbatch {command}: error: rendezvous{where} failed: {first}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(saved_environ)
