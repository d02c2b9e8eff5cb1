"""The bench's CPU split by process (outbox_embedded/cpu_split.py) on real processes: a
listener is found by its port, and a tree's CPU includes its children, living or reaped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from outbox_embedded.cpu_split import CpuSplit, broker_port, dsn_port, listener_pid, tree_cpu_s
from tests.fixtures.procs import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A parent that listens on a port, prints it, starts a child that burns ~0.3 s of CPU and
# exits (reaped), then another that burns CPU until killed with the parent.
TREE = textwrap.dedent("""
    import socket, subprocess, sys, time
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    print(s.getsockname()[1], flush=True)
    burn = "import time\\nend = time.process_time() + float(__import__('sys').argv[1])\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn, "0.3"], check=True)
    child = subprocess.Popen([sys.executable, "-c", burn, "1000"])
    print(child.pid, flush=True)
    sys.stdin.read()
    child.kill()
""")


def test_a_listener_is_found_by_port_and_its_tree_counts_living_and_reaped_children() -> None:
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        port = int(parent.stdout.readline())
        child = int(parent.stdout.readline())
        assert listener_pid(port) == parent.pid
        split = CpuSplit.of_ports(port, None)
        assert split.roots == {"postgres": parent.pid}  # the name is the caller's; no broker port
        before = split.snapshot()
        # The reaped child's 0.3 s is in the parent's tree already.
        assert before["postgres"] >= 0.25
        # The living grandchild burns CPU meanwhile; a fixed 0.5 s gave it 0.18 s of CPU
        # once in CI, beside the other test workers on two cores: wait for its 0.2 s.
        def grown() -> dict[str, float] | None:
            now = split.snapshot()
            return now if now["postgres"] - before["postgres"] >= 0.2 else None

        after = wait_until(grown, timeout_s=20, interval_s=0.1,
                           message="the living grandchild's CPU never reached the tree's figure")
        assert after["postgres"] - before["postgres"] >= 0.2
        assert tree_cpu_s(child) <= after["postgres"]
        per_row = CpuSplit.per_row(before, after, 1000)
        assert per_row["postgres"] >= 200  # µs per row: >= 0.2 s over 1,000 rows
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait(10)


def test_no_listener_no_tree() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # bound, not listening
    try:
        assert listener_pid(port) is None
        assert CpuSplit.of_ports(port, port).roots == {}
    finally:
        s.close()
    assert tree_cpu_s(2**22 + 12345) == 0.0  # no such process


def test_only_servers_on_this_machine_are_looked_for() -> None:
    assert dsn_port("postgresql://u@localhost:5433/db") == 5433
    assert dsn_port("host=/tmp/sock port=6000 dbname=x") == 6000
    assert dsn_port("dbname=x") == 5432
    assert dsn_port("postgresql://u@db.example.com:5432/db") is None
    assert broker_port("127.0.0.1:9092,other:9092") == 9092
    assert broker_port("[::1]:19092") == 19092
    assert broker_port("kafka-1.example.com:9092") is None


def _fake_stat(proc: Path, pid: int, ppid: int, ticks: int, child_ticks: int = 0) -> None:
    (proc / str(pid)).mkdir(exist_ok=True)
    fields = ["S", str(ppid), *["0"] * 9, str(ticks), "0", str(child_ticks), "0"]
    (proc / str(pid) / "stat").write_text(f"{pid} (server) {' '.join(fields)}\n")


def test_a_child_reaped_during_the_scan_is_neither_lost_nor_counted_twice(tmp_path, monkeypatch) -> None:
    """The bench's smoke test read a negative CPU per row on CI (6d98313, the Kafka variant):
    a backend that ended and was reaped during the scan was missing from the snapshot (or,
    read before its parent, counted twice).  Here a fake /proc reaps the child into its
    parent in the middle of a scan."""
    from outbox_embedded import cpu_split

    hz = os.sysconf("SC_CLK_TCK")
    _fake_stat(tmp_path, 10, 1, ticks=2 * hz)  # the postmaster: 2 s of its own
    _fake_stat(tmp_path, 11, 10, ticks=3 * hz)  # a backend: 3 s
    monkeypatch.setattr(cpu_split, "_PROC", tmp_path)
    read = cpu_split._stat
    reaped: list[int] = []

    def racing_stat(pid: int) -> Any:
        # The backend ends and is reaped just after the first of the two is read: read
        # parent first, the old scan lost the backend's 3 s (2.0); child first, it counted
        # them twice (8.0), whichever order the directory lists them in.
        stat = read(pid)
        if pid in (10, 11) and not reaped:
            reaped.append(11)
            (tmp_path / "11" / "stat").unlink()
            (tmp_path / "11").rmdir()
            _fake_stat(tmp_path, 10, 1, ticks=2 * hz, child_ticks=3 * hz)
        return stat

    monkeypatch.setattr(cpu_split, "_stat", racing_stat)
    assert tree_cpu_s(10) == 5.0
    assert reaped == [11]
