"""The TCP fault proxy against a tiny local echo server."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.fixtures.procs import wait_until
from tests.fixtures.proxy import TcpProxy


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        try:
            while data := sock.recv(65536):
                sock.sendall(data)
        except OSError:
            pass


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = _EchoServer(("127.0.0.1", 0), _EchoHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def proxy(echo_port: int) -> Iterator[TcpProxy]:
    p = TcpProxy("127.0.0.1", echo_port).start()
    try:
        yield p
    finally:
        p.stop()


def _connect(port: int, timeout: float = 2.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _roundtrip(s: socket.socket, payload: bytes) -> bytes:
    s.sendall(payload)
    return _recv_exact(s, len(payload))


def _is_broken(s: socket.socket) -> bool:
    """True when the peer closed/reset the connection (EOF or an error on recv)."""
    try:
        s.sendall(b"x")
        return s.recv(1) == b""
    except OSError:  # ConnectionResetError, BrokenPipeError, TimeoutError
        return True


def _new_connection_is_refused(port: int) -> bool:
    """A new connection is reset (the RST may even beat connect()'s return) or closed."""
    try:
        s = _connect(port)
    except OSError:
        return True
    with s:
        s.settimeout(2)
        return _is_broken(s)


def test_data_flows_both_ways(proxy: TcpProxy) -> None:
    with _connect(proxy.port) as s:
        assert _roundtrip(s, b"hello") == b"hello"
        big = bytes(range(256)) * 4096  # 1 MiB: exercises flow control
        s.sendall(big)
        assert _recv_exact(s, len(big)) == big
        wait_until(lambda: proxy.connections == 1, 2, message="one proxied connection")


def test_many_connections_and_messages(proxy: TcpProxy) -> None:
    socks = [_connect(proxy.port) for _ in range(50)]
    try:
        wait_until(lambda: proxy.connections == 50, 5, message="50 connections")
        started = time.monotonic()
        for i in range(40):
            for j, s in enumerate(socks):
                msg = f"{i}:{j};".encode()
                assert _roundtrip(s, msg) == msg
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"2000 round trips took {elapsed:.1f}s"
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: proxy.connections == 0, 5, message="closed connections are forgotten")


def test_cut_breaks_connections_and_refuses_new_ones(proxy: TcpProxy) -> None:
    s = _connect(proxy.port)
    assert _roundtrip(s, b"before") == b"before"
    proxy.cut()
    assert proxy.connections == 0
    s.settimeout(2)
    assert _is_broken(s)
    s.close()

    for _ in range(3):  # accepted by the kernel, then reset by the proxy
        assert _new_connection_is_refused(proxy.port)

    proxy.restore()
    with _connect(proxy.port) as s3:
        assert _roundtrip(s3, b"after") == b"after"


def test_set_delay_delays_each_direction(proxy: TcpProxy) -> None:
    with _connect(proxy.port) as s:
        t0 = time.monotonic()
        _roundtrip(s, b"warm")
        baseline = time.monotonic() - t0

        proxy.set_delay(200)
        t0 = time.monotonic()
        assert _roundtrip(s, b"slow") == b"slow"
        delayed = time.monotonic() - t0
        # 200 ms each way: the round trip crosses the proxy twice
        assert delayed >= 0.35, f"round trip {delayed * 1000:.0f} ms with 200 ms delay"
        assert baseline < 0.1

        proxy.set_delay(0)
        t0 = time.monotonic()
        _roundtrip(s, b"fast")
        assert time.monotonic() - t0 < 0.1


def test_delay_keeps_order_of_a_stream(proxy: TcpProxy) -> None:
    proxy.set_delay(20)
    with _connect(proxy.port) as s:
        payload = b"".join(f"{i:06d}".encode() for i in range(5000))
        for i in range(0, len(payload), 600):
            s.sendall(payload[i : i + 600])
        assert _recv_exact(s, len(payload)) == payload


def test_blackhole_holds_data_until_restore(proxy: TcpProxy) -> None:
    s = _connect(proxy.port)
    assert _roundtrip(s, b"ping") == b"ping"
    proxy.blackhole()
    s.sendall(b"lost?")
    s.settimeout(0.5)
    with pytest.raises(TimeoutError):
        s.recv(10)

    s2 = _connect(proxy.port)  # new connections are accepted but silent
    s2.sendall(b"new")
    s2.settimeout(0.3)
    with pytest.raises(TimeoutError):
        s2.recv(10)
    assert proxy.connections == 2

    proxy.restore()  # the partition heals: held data is delivered, in order
    s.settimeout(2)
    s2.settimeout(2)
    assert _recv_exact(s, 5) == b"lost?"
    assert _recv_exact(s2, 3) == b"new"
    assert _roundtrip(s, b"again") == b"again"
    s.close()
    s2.close()


def test_cut_during_blackhole_and_stop_is_idempotent(echo_port: int) -> None:
    p = TcpProxy("127.0.0.1", echo_port).start()
    s = _connect(p.port)
    p.blackhole()
    p.cut()
    s.settimeout(2)
    assert _is_broken(s)
    s.close()
    p.restore()
    with _connect(p.port) as s2:
        assert _roundtrip(s2, b"ok") == b"ok"
    p.stop()
    p.stop()
    with pytest.raises(OSError):
        _connect(p.port, timeout=1).close()


def test_fixed_listen_port_and_unreachable_target() -> None:
    with socket.socket() as tmp:
        tmp.bind(("127.0.0.1", 0))
        dead_port = tmp.getsockname()[1]  # nothing listens there once closed
    with TcpProxy("127.0.0.1", dead_port) as p:
        try:
            s = _connect(p.port)
        except ConnectionResetError:
            pass  # reset before connect() even returned: the same outcome, only faster
        else:
            s.settimeout(2)
            assert _is_broken(s)  # the upstream connect fails: the client is reset
            s.close()
        wait_until(lambda: p.connections == 0, timeout_s=5)
