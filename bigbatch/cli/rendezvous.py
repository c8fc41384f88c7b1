"""torchrun's c10d rendezvous with its stores listening on one address, not on all.

torch's TCPStore server listens on every interface whatever host name it is given
(torch 2.13 binds `*:PORT`), and torchrun's agent holds two of them: the rendezvous
store at the endpoint, and the store it shares with its workers (their MASTER_ADDR
and MASTER_PORT). Neither asks who connects. A TCPStore also takes a socket that is
already bound (`master_listen_fd`), and torch's rendezvous registry takes named
handlers: `BACKEND` is torch's own c10d rendezvous (its `DynamicRendezvousHandler`
over its `C10dRendezvousBackend`: the same protocol and keys, so a node that plain
torchrun started joins it) whose two stores are bound here first:

- a single-node job (torchrun's `--standalone`): both on 127.0.0.1, ephemeral ports;
- `--rdzv-endpoint HOST:PORT`: the rendezvous store on HOST's address (on the node
  that holds that address), the shared store on this node's address towards HOST (the
  interface the nodes reach each other on), which is the MASTER_ADDR workers get.

Where that address is a loopback one, the workers' gloo and NCCL sockets are kept on
the loopback interface too (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`, unless set).
Other rendezvous backends (`static`, `etcd`) are torch's, unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import socket
import uuid
from datetime import timedelta

__all__ = ["BACKEND", "LOOPBACK", "bind_rendezvous", "local_address", "loopback_env"]

BACKEND = "bigbatch-c10d"
"""The rendezvous backend name bigbatch's launcher uses in place of torchrun's `c10d`."""
LOOPBACK = "127.0.0.1"
_BACKLOG = 512


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`'s first address and `port` (0: any free one), listening."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _bound_store(host: str, port: int, timeout: timedelta | None = None):
    """A TCPStore server that listens on `host` only (the store owns the socket: detached)."""
    import torch.distributed as dist

    sock = _listening_socket(host, port)
    address, port = sock.getsockname()[:2]
    extra = {} if timeout is None else {"timeout": timeout}
    return dist.TCPStore(address, port, is_master=True, multi_tenant=True,
                         master_listen_fd=sock.detach(), **extra)


def _rendezvous_store(params):
    """The rendezvous store at `params.endpoint`: its server where this machine can bind the
    endpoint's address and port (or `is_host=true` says so), else a client of it."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    is_host = params.get_as_bool("is_host")
    if is_host is not False:
        try:
            return _bound_store(host, port, timeout)
        except OSError as e:  # not this machine's address, or another process serves it
            if is_host:
                raise RendezvousConnectionError(
                    f"cannot listen on {host}:{port} for the rendezvous store: {e}") from e
    try:
        return dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    except (ValueError, RuntimeError, TimeoutError) as e:
        raise RendezvousConnectionError(
            f"the connection to the rendezvous store at {host}:{port} failed: {e}") from e


def _handler_classes():
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return BACKEND

    class Handler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr, master_port):
            # The store shared with the workers: on this node's address (--local-addr).
            return _bound_store(master_addr, master_port)

    return Backend, Handler


def _create_handler(params):
    """torch's `create_handler` for c10d, with the bound stores (`RendezvousHandlerCreator`)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    backend_cls, handler_cls = _handler_classes()
    store = _rendezvous_store(params)

    def seconds(name: str) -> timedelta | None:
        value = params.get_as_int(f"{name}_timeout")
        return None if value is None else timedelta(seconds=value)

    timeout = RendezvousTimeout(seconds("join"), seconds("last_call"), seconds("close"),
                                seconds("heartbeat"))
    return handler_cls.from_backend(
        params.run_id, store, backend_cls(store, params.run_id), params.min_nodes,
        params.max_nodes, params.local_addr, timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3))


def local_address(host: str, port: int) -> str:
    """This machine's address on its way to `host` (the source address the kernel picks for
    it: the interface the other nodes reach this one on); no packet is sent."""
    family, _, _, _, addr = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _is_loopback(address: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    return False


def loopback_env() -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the loopback interface (`lo` on Linux,
    `lo0` on macOS); {} where there is none by those names."""
    names = {name for _, name in socket.if_nameindex()}
    name = next((n for n in ("lo", "lo0") if n in names), None)
    return {} if name is None else {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


def bind_rendezvous(args: argparse.Namespace) -> dict[str, str]:
    """Rewrite torchrun's parsed `args` so that a c10d rendezvous (`--standalone`, or
    `--rdzv-backend c10d`) runs as `BACKEND`, and register it with torch. Returns the
    environment the workers need on top (the loopback interface for their sockets, where
    the job's address is a loopback one)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if args.standalone:
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint = BACKEND, f"{LOOPBACK}:0"
        args.rdzv_id = str(uuid.uuid4())
        args.local_addr = LOOPBACK
    elif args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        args.rdzv_backend = BACKEND
        if not args.local_addr:
            host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
            args.local_addr = local_address(host, port)
    else:
        return {}
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return loopback_env() if _is_loopback(args.local_addr) else {}
