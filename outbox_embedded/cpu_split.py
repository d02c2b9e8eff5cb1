"""Where a run's CPU goes, by process: the bench's split of a drain's CPU per row between
the relay, PostgreSQL (the postmaster and every backend) and the broker (issue 18's "a
profile of where the time goes" for the drain targets).

The servers are found by the local port they listen on (the DSN's, the bootstrap
server's), so the split covers the embedded servers and any local ones given with
``--dsn`` / ``--bootstrap-servers``; a remote server, or one whose sockets this user cannot
see, is left out of the split rather than guessed.  A process tree's CPU is its
processes' user + system time, with the time of children they already reaped (a backend
that exits between two snapshots moves its CPU into the postmaster's).  Linux only: on
another system the split is empty.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import psycopg

_PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def listener_pid(port: int) -> int | None:
    """The process listening on local TCP ``port`` (IPv4 or IPv6), or None."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    pids = sorted(int(p.name) for p in _PROC.iterdir() if p.name.isdigit())
    for pid in pids:
        try:
            fds = list((_PROC / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    return pid  # the postmaster holds the socket; its backends inherit none
            except OSError:
                continue
    return None


def dsn_port(dsn: str) -> int | None:
    """The DSN's port when its server is on this machine (a loopback host name, a socket
    directory, or no host), else None."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    host = str(params.get("host") or "")
    if host and not host.startswith("/") and host not in _LOCAL_HOSTS:
        return None
    return int(params.get("port") or 5432)


def broker_port(bootstrap: str) -> int | None:
    """The first bootstrap server's port when it is on this machine's loopback, else None."""
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    return int(port) if host.strip("[]") in _LOCAL_HOSTS and port.isdigit() else None


_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds including reaped children) of ``pid``."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return int(fields[1]), ticks / os.sysconf("SC_CLK_TCK")


#: Scans of /proc tried before a snapshot is taken with a process ending during it.
_SCANS = 5


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and all its descendants (0.0 when it is gone).

    /proc is read one process at a time, so a descendant that ends and is reaped during
    the scan could be missed (its parent read before it got the child's time, the child
    gone when its turn came) or counted twice (read, then reaped into a parent read after
    it): a snapshot lower than the one before it, a negative CPU per row.  A scan during
    which a process of the tree ended is done again (up to ``_SCANS`` times)."""
    for _scan in range(_SCANS):
        total, steady = _tree_scan(root)
        if steady:
            break
    return total


def _tree_scan(root: int) -> tuple[float, bool]:
    """``root``'s tree's CPU seconds, and whether every process of it listed was still
    there once the scan ended."""
    listed = [int(entry.name) for entry in _PROC.iterdir() if entry.name.isdigit()]
    stats = {}
    vanished = False
    for pid in listed:
        stat = _stat(pid)
        if stat is None:
            vanished = True  # ended between the listing and its read: perhaps in the tree
        else:
            stats[pid] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _cpu) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo, tree = 0.0, [root], []
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            tree.append(pid)
            todo.extend(children.get(pid, ()))
    steady = not vanished and all((_PROC / str(pid)).exists() for pid in tree)
    return total, steady


class CpuSplit:
    """CPU snapshots of named process trees (``{"postgres": pid, "broker": pid}``)."""

    def __init__(self, roots: Mapping[str, int]) -> None:
        self.roots = dict(roots)

    @classmethod
    def of_servers(cls, dsn: str | None = None, bootstrap: str | None = None) -> CpuSplit:
        """The servers of ``dsn`` ("postgres") and ``bootstrap`` ("broker") that listen on
        this machine (those found)."""
        return cls.of_ports(dsn_port(dsn) if dsn else None, broker_port(bootstrap) if bootstrap else None)

    @classmethod
    def of_ports(cls, postgres_port: int | None, broker_port: int | None) -> CpuSplit:
        """The local processes listening on these ports (those found)."""
        roots = {}
        for name, port in (("postgres", postgres_port), ("broker", broker_port)):
            pid = listener_pid(port) if port else None
            if pid is not None:
                roots[name] = pid
        return cls(roots)

    def snapshot(self) -> dict[str, float]:
        return {name: tree_cpu_s(pid) for name, pid in self.roots.items()}

    @staticmethod
    def per_row(before: Mapping[str, float], after: Mapping[str, float], rows: int) -> dict[str, float]:
        """µs of CPU per row of each tree between two snapshots."""
        return {name: round((after[name] - before[name]) / max(rows, 1) * 1e6, 1)
                for name in before if name in after}
