"""Issue 15, item 8: the health server holds up against idle, half-open and rude clients.

1,000 idle connections and 100 half-open requests must not hold a thread each, nor
keep `/healthz` (the liveness probe) from answering within a second; clients that
reset mid-answer leave no traceback on stderr."""

from __future__ import annotations

import http.client
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from relay.http import HealthServer
from tests.fixtures.procs import wait_until


def _server(**limits: float) -> HealthServer:
    registry = CollectorRegistry()
    Counter("outbox_relay_test_total", "a metric to scrape", registry=registry).inc()
    return HealthServer(host="127.0.0.1", port=0, registry=registry,
                        health=lambda: (True, {"pending": 0}),
                        ready=lambda: (True, {"database": True}), **limits)  # type: ignore[arg-type]


@pytest.fixture
def many_fds() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < 2500:
        pytest.skip(f"needs ~2,500 file descriptors, the hard limit is {hard}")


@pytest.fixture
def clients() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def _get(port: int, path: str, timeout_s: float = 1.0) -> tuple[int, bytes, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read(), time.monotonic() - started
    finally:
        conn.close()


def _reset(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN (SO_LINGER 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_idle_and_half_open_connections_do_not_take_the_probes_down(many_fds, clients, capfd):
    server = _server()
    base_threads = threading.active_count()
    server.start()
    try:
        for _ in range(1000):
            clients.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        for _ in range(100):  # half-open: a request head that never ends
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: relay\r\n")
            clients.append(s)
        for path in ("/healthz", "/readyz", "/metrics", "/healthz"):
            status, body, took = _get(server.port, path)
            assert status == 200, body
            assert took < 1.0, f"{path} took {took:.2f}s with 1,100 idle connections"
        assert b"outbox_relay_test_total" in _get(server.port, "/metrics")[1]
        assert threading.active_count() - base_threads <= 2, threading.enumerate()

        # Rude clients: a reset before the answer is written, and mid-answer.
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: relay\r\n\r\n")
            _reset(s)
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            _reset(s)
        status, _, took = _get(server.port, "/healthz")
        assert status == 200 and took < 1.0
    finally:
        server.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err


def test_a_connection_that_sends_nothing_is_closed_after_the_timeout(clients):
    server = _server(timeout_s=0.3)
    server.start()
    try:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        clients.append(s)
        s.sendall(b"GET /healthz HTTP/1.1\r\n")  # and then nothing
        assert s.recv(100) == b""  # closed by the server, well before the 5 s client timeout
        wait_until(lambda: server.open_connections == 0, timeout_s=2,
                   message="the idle connection is still open")
        assert server.timed_out >= 1
        # Answers: 404 for an unknown path, 405 for a POST, HEAD without a body.
        assert _get(server.port, "/nope")[0] == 404
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1)
        conn.request("POST", "/healthz", body=b"x")
        assert conn.getresponse().status == 405
        conn.close()
    finally:
        server.stop()
        server.stop()  # idempotent
