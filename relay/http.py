"""``/metrics``, ``/healthz`` and ``/readyz`` on a small threaded HTTP server.

No endpoint changes state.  ``/healthz`` answers whether the loop is alive and
making progress: it fails when the loop stopped ticking, or when rows are pending
and nothing was published for ``stuck_after_s``.  ``/readyz`` answers whether the
database and the broker are reachable and the schema is present.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

Check = Callable[[], tuple[bool, dict[str, Any]]]


class HealthServer:
    def __init__(self, *, host: str, port: int, registry: CollectorRegistry,
                 health: Check, ready: Check) -> None:
        self._registry = registry
        self._health = health
        self._ready = ready
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body = generate_latest(outer._registry)
                    self._send(200, body, CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/readyz"):
                    check = outer._health if path == "/healthz" else outer._ready
                    ok, detail = check()
                    self._send(200 if ok else 503, json.dumps({"ok": ok, **detail}).encode(),
                               "application/json")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return  # scrapes every few seconds would drown the event log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._server.serve_forever, name="outbox-relay-http",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._thread = None
