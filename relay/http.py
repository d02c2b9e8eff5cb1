"""``/metrics``, ``/healthz``, ``/readyz`` and ``/startupz`` on a small selector-based HTTP server.

No endpoint changes state.  ``/healthz`` answers whether the loop is alive and
making progress: it fails when the loop stopped ticking, or when rows are pending
and nothing was published for ``stuck_after_s``.  ``/readyz`` answers whether the
database and the broker are reachable and the schema is present.  ``/startupz``
answers whether the relay got through its start: the database reached and the schema
found, whatever Kafka does (a sidecar's startupProbe: see deploy/k8s/deployment.yaml).

One thread serves every connection, whatever clients do: the requests are tiny
and the answers computed in microseconds, so nothing is gained by a thread per
connection, and idle, half-open or slow clients must not be able to take the
probes down.  Limits (each a keyword with a default):

* at most ``max_connections`` open connections; one more evicts the connection
  that has waited longest without completing its request;
* ``timeout_s`` to send the request head and to read the answer, then the
  connection is closed;
* a request head of at most ``MAX_REQUEST_BYTES``; one request per connection
  (``Connection: close``);
* a client that resets or goes away is dropped silently (no traceback).
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

Check = Callable[[], tuple[bool, dict[str, Any]]]

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
LISTEN_BACKLOG = 256
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the answer being written


class HealthServer:
    def __init__(self, *, host: str, port: int, registry: CollectorRegistry,
                 health: Check, ready: Check, started: Check | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._checks = {b"/healthz": health, b"/readyz": ready, b"/startupz": started or ready}
        self.max_connections = max(1, max_connections)
        self.timeout_s = timeout_s
        self._clock = clock
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[int, _Conn] = {}  # by file descriptor, in accept order
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.evicted = 0  # connections closed to make room (tests, debugging)
        self.timed_out = 0

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="outbox-relay-http", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (waiting up to ``timeout_s`` for the thread) and close every
        connection.  Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None
        for conn in list(self._conns.values()):
            self._close(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    # -- the loop (one thread) -------------------------------------------------------------

    def _serve(self) -> None:
        while self.run_once():
            pass

    def run_once(self, timeout_s: float = 1.0) -> bool:
        """One round of the server's loop: wait up to ``timeout_s`` (less when a connection's
        deadline comes first) for sockets that are ready, serve them, close connections
        past their deadline.  Returns False once ``stop`` was asked."""
        if self._stopping.is_set():
            return False
        now = self._clock()
        soonest = min((c.deadline for c in self._conns.values()), default=now + timeout_s)
        for key, mask in self._selector.select(timeout=max(0.0, min(timeout_s, soonest - now))):
            if key.data == "listen":
                self._accept()
            elif key.data == "wake":
                return False
            else:
                conn = self._conns.get(key.fd)
                if conn is None:
                    continue
                if mask & selectors.EVENT_READ:
                    self._read(conn)
                elif mask & selectors.EVENT_WRITE:
                    self._write(conn)
        now = self._clock()
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self.timed_out += 1
            self._close(conn)
        return not self._stopping.is_set()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, a reset before accept(): try later
                return
            if len(self._conns) >= self.max_connections:
                self._evict_one()
            sock.setblocking(False)
            conn = _Conn(sock, self._clock() + self.timeout_s)
            self._conns[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, "conn")

    def _evict_one(self) -> None:
        """Close the connection that has waited longest for its request head."""
        waiting = [c for c in self._conns.values() if c.out is None] or list(self._conns.values())
        self.evicted += 1
        self._close(min(waiting, key=lambda c: c.deadline))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        conn.head += data
        end = conn.head.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.head) > MAX_REQUEST_BYTES:
                self._answer(conn, 431, b"request too large\n", "text/plain", head_only=False)
            return
        self._answer(conn, *self._respond(bytes(conn.head[:end])))

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # broken pipe, reset: the client went away
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)

    def _answer(self, conn: _Conn, status: int, body: bytes, content_type: str,
                head_only: bool) -> None:
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n").encode()
        conn.out = memoryview(head if head_only else head + body)
        conn.deadline = self._clock() + self.timeout_s
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, "conn")
        self._write(conn)

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # -- routes ---------------------------------------------------------------------------

    def _respond(self, head: bytes) -> tuple[int, bytes, str, bool]:
        """(status, body, content type, whether to send the head only) for a request head."""
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b"bad request\n", "text/plain", False
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, b"method not allowed\n", "text/plain", False
        head_only = method == b"HEAD"
        try:
            if target == b"/metrics":
                return 200, generate_latest(self._registry), CONTENT_TYPE_LATEST, head_only
            check = self._checks.get(target)
            if check is not None:
                ok, detail = check()
                return (200 if ok else 503, json.dumps({"ok": ok, **detail}).encode(),
                        "application/json", head_only)
        except Exception as exc:  # noqa: BLE001 - a failing check answers 500, the server lives on
            return 500, f"{type(exc).__name__}\n".encode(), "text/plain", head_only
        return 404, b"not found\n", "text/plain", head_only
