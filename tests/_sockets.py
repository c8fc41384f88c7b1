"""The TCP sockets a process tree listens on, read from /proc as `ss -ltnp` reads them.

    listening(pid)   # {pid: ["127.0.0.1:41234", ...]} for pid and every process below it
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += parents.get(p, [])
    return found


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's `0100007F:1F90` -> `127.0.0.1:8080` (tcp6's 32 hex digits likewise)."""
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
    return f"{ipaddress.ip_address(raw)}:{int(port, 16)}"


def listening(pid: int) -> dict[int, list[str]]:
    """pid -> the addresses its listening TCP sockets are bound to, for `pid`'s process tree."""
    table: dict[str, str] = {}
    for name in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":  # TCP_LISTEN
                table[fields[9]] = _address(fields[1])
    held: dict[int, list[str]] = {}
    for p in _tree(pid):
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
            if inode in table:
                held.setdefault(p, []).append(table[inode])
    return held


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.rsplit(":", 1)[0]).is_loopback
