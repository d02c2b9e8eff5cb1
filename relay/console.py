"""``outbox-relay console``: a small server-rendered web console.

Secure by default: it binds 127.0.0.1 (``--console-host`` to change), answers only
requests whose Host is the address it serves (no DNS rebinding), and is read-only
unless started with ``--console-actions``.  Actions then need a signed-in session:
the operator gives a name (for the action log) and the console token
(``OUTBOX_RELAY_CONSOLE_TOKEN`` or ``..._TOKEN_FILE``; compared in constant time).  Every
POST carries the session's CSRF token in a form field, the session cookie is
``HttpOnly; SameSite=Strict``, and the request's Origin (or Referer) must be the
console's own.  Every action is logged (``console_action``: who, from where, what,
the result).  Pages carry no script; a strict Content-Security-Policy forbids any.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from relay.config import Settings
from relay.console_store import ConsoleStore
from relay.errors import ConfigError, DatabaseUnavailable

COOKIE = "outbox_console"
SESSION_TTL_S = 8 * 3600
MIN_TOKEN_CHARS = 16
REQUEST_TIMEOUT_S = 10.0
MAX_FORM_BYTES = 16 * 1024
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin", "Cache-Control": "no-store",
}


@dataclass
class Session:
    who: str
    csrf: str
    expires: float


class Console:
    """The console's state: settings, store, sessions.  One request at a time."""

    def __init__(self, settings: Settings, *, log: Any, clock: Callable[[], float] = time.monotonic) -> None:
        if settings.console_actions and not settings.console_token:
            raise ConfigError("--console-actions needs a token: set OUTBOX_RELAY_CONSOLE_TOKEN_FILE "
                              "(a file holding it) or OUTBOX_RELAY_CONSOLE_TOKEN")
        if settings.console_token is not None and len(settings.console_token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"the console token must have at least {MIN_TOKEN_CHARS} characters")
        self.settings = settings
        self.actions = settings.console_actions
        self.log = log
        self.clock = clock
        self.store = ConsoleStore(settings.dsn, application_name="outbox-relay-console", table=settings.table)
        self.sessions: dict[str, Session] = {}
        self.login_csrf: dict[str, float] = {}
        self.hosts: set[str] = set()

    def allow_hosts(self, host: str, port: int) -> None:
        names = {_url_host(host)} if host not in ("0.0.0.0", "::", "") else set()  # noqa: S104 - compared, not bound
        if host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::"):  # noqa: S104
            names |= {"127.0.0.1", "localhost", "[::1]"}
        self.hosts = {f"{name}:{port}" for name in names}

    def session(self, cookie_header: str | None) -> tuple[str, Session] | None:
        if not cookie_header:
            return None
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(cookie_header)
        except Exception:  # noqa: BLE001 - a malformed cookie is no session
            return None
        morsel = jar.get(COOKIE)
        if morsel is None:
            return None
        found = self.sessions.get(morsel.value)
        if found is None or found.expires < self.clock():
            self.sessions.pop(morsel.value, None)
            return None
        return morsel.value, found

    def sign_in(self, who: str, token: str) -> str | None:
        """A new session id when ``token`` is the console's token, else None."""
        expected = self.settings.console_token or ""
        if not self.actions or not hmac.compare_digest(token.encode(), expected.encode()):
            return None
        sid = secrets.token_urlsafe(32)
        self.sessions[sid] = Session(who, secrets.token_urlsafe(32), self.clock() + SESSION_TTL_S)
        return sid

    def new_login_csrf(self) -> str:
        now = self.clock()
        self.login_csrf = {t: exp for t, exp in self.login_csrf.items() if exp > now}
        token = secrets.token_urlsafe(24)
        self.login_csrf[token] = now + 600
        return token


def _form(handler: BaseHTTPRequestHandler) -> dict[str, str]:
    length = int(handler.headers.get("Content-Length") or 0)
    if length > MAX_FORM_BYTES:
        raise ValueError("form too large")
    body = handler.rfile.read(length).decode("utf-8", errors="replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


def make_handler(console: Console) -> type[BaseHTTPRequestHandler]:
    from relay.console_routes import Routes

    class Handler(BaseHTTPRequestHandler):
        server_version = "outbox-relay-console"
        sys_version = ""
        timeout = REQUEST_TIMEOUT_S

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
            console.log.debug("console_request", client=self.client_address[0], line=format % args)

        def _host_ok(self) -> bool:
            return (self.headers.get("Host") or "") in console.hosts  # none allowed: none served

        def _origin_ok(self) -> bool:
            origin = self.headers.get("Origin")
            if origin is None or origin == "null":
                referer = self.headers.get("Referer")
                if referer is None:
                    return False
                parts = urlsplit(referer)
                origin = f"{parts.scheme}://{parts.netloc}"
            return origin == f"http://{self.headers.get('Host')}"

        def send_page(self, status: int, body: str, *, cookie: str | None = None,
                      content_type: str = "text/html; charset=utf-8") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in HEADERS.items():
                self.send_header(name, value)
            if cookie is not None:
                self.send_header("Set-Cookie", cookie)
            self.end_headers()
            self.wfile.write(data)

        def redirect(self, to: str, *, cookie: str | None = None) -> None:
            self.send_response(HTTPStatus.SEE_OTHER)
            self.send_header("Location", to)
            self.send_header("Content-Length", "0")
            if cookie is not None:
                self.send_header("Set-Cookie", cookie)
            self.end_headers()

        def do_GET(self) -> None:  # noqa: N802 - stdlib's name
            if not self._host_ok():
                self.send_page(HTTPStatus.MISDIRECTED_REQUEST, "unknown host", content_type="text/plain")
                return
            parts = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            Routes(console, self).get(unquote(parts.path), query)

        def do_POST(self) -> None:  # noqa: N802 - stdlib's name
            if not self._host_ok() or not self._origin_ok():
                console.log.warning("console_refused", client=self.client_address[0], path=self.path,
                                    reason="host_or_origin")
                self.send_page(HTTPStatus.FORBIDDEN, "cross-site request refused", content_type="text/plain")
                return
            try:
                form = _form(self)
            except ValueError:
                self.send_page(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "form too large", content_type="text/plain")
                return
            Routes(console, self).post(urlsplit(self.path).path, form)

    return Handler


def _url_host(host: str) -> str:
    """The host as a URL and a Host header write it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _server_class(host: str) -> type[HTTPServer]:
    """HTTPServer binds IPv4 only: --console-host ::1 failed ("Address family for hostname not
    supported") where --metrics-host ::1 works (relay/http.py chooses the family the same way)."""
    if ":" not in host:
        return HTTPServer

    class HTTPServerV6(HTTPServer):
        address_family = socket.AF_INET6

    return HTTPServerV6


def serve(settings: Settings, *, log: Any, ready: Callable[[str], None] = print) -> HTTPServer:
    """Bind the console; ``ready`` receives its URL.  The caller runs ``serve_forever``."""
    console = Console(settings, log=log)
    try:  # credentials, the DSN or the schema that are wrong now stay wrong: say so and stop
        console.store.check_schema()
    except DatabaseUnavailable as exc:  # may come back: the pages say so meanwhile
        log.warning("console_database_unavailable", error=str(exc))
    try:
        server = _server_class(settings.console_host)((settings.console_host, settings.console_port),
                                                      make_handler(console))
    except OSError as exc:
        raise ConfigError(f"--console-host/--console-port: cannot listen on {settings.console_host}:"
                          f"{settings.console_port}: {exc.strerror or exc}") from None
    port = int(server.server_address[1])
    console.allow_hosts(settings.console_host, port)
    url = f"http://{_url_host(settings.console_host)}:{port}/"
    log.info("console_listening", url=url, actions=console.actions)
    ready(f"console listening on {url} ({'actions enabled' if console.actions else 'read-only'})")
    return server


def main(settings: Settings) -> int:
    import signal
    import sys
    import threading

    from relay import logs

    server = serve(settings, log=logs.get(), ready=lambda line: print(line, flush=True))

    def stop(_signum: int, _frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    sys.stdout.flush()
    return 0
