"""free_port: ports outside the ephemeral range, reserved across processes until exit.

A CI run failed when an Apache Kafka node, seconds into its JVM start, could not bind the
client port free_port had handed out: something else took the port in the meantime.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from outbox_embedded import procs
from outbox_embedded.procs import free_port, port_is_free


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range on this machine")


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert all(15000 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) == len(ports)
    assert all(port_is_free(p) for p in ports)


def test_a_port_another_process_reserved_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from outbox_embedded.procs import free_port; "
         "print(free_port(), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        theirs = int(child.stdout.readline())
        assert port_is_free(theirs)  # reserved, not bound: only the lock protects it
        monkeypatch.setattr(procs, "_candidate_ports", lambda: [theirs, theirs, theirs])
        mine = free_port()
        assert mine != theirs
    finally:
        child.communicate("", timeout=10)
    monkeypatch.setattr(procs, "_candidate_ports", lambda: [theirs])
    assert free_port() == theirs  # the reservation ended with the process
