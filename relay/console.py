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
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
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
#: Connections served at once; more are closed unanswered (each is a thread reading it).
MAX_CONNECTIONS = 64
#: Sign-in forms handed out and not yet used; past it the oldest is forgotten.
MAX_LOGIN_FORMS = 1000
#: Refused sign-ins within ``SIGN_IN_WINDOW_S`` before every sign-in is refused (429) until
#: the oldest of them leaves the window: a token guessed at no more than this rate.
MAX_REFUSED_SIGN_INS = 10
SIGN_IN_WINDOW_S = 60.0
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
    """The console's state: settings, store, sessions.  One request at a time (``lock``)."""

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
        self.store = ConsoleStore(settings.dsn, application_name="outbox-relay-console", table=settings.table,
                                  one_shot=True)
        self.sessions: dict[str, Session] = {}
        self.login_csrf: dict[str, float] = {}
        self.refused_sign_ins: list[float] = []
        self.hosts: set[str] = set()
        #: Requests are read on threads of their own (one slow client held every other one
        #: for as long as it trickled bytes); what they do runs under this lock, one at a time.
        self.lock = threading.Lock()
        #: Signs an action's result shown after its redirect (``?done=``): any text in that
        #: parameter was shown in the banner, a link could put a fake result or a phishing
        #: line inside the console (an audit of its web security).
        self.flash_key = secrets.token_bytes(32)

    def flash_sig(self, text: str) -> str:
        return hmac.new(self.flash_key, text.encode("utf-8", "backslashreplace"), "sha256").hexdigest()[:32]

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
        # Bounded: each GET of /login made one, kept ten minutes, however many were asked for.
        now = self.clock()
        live = [(t, exp) for t, exp in self.login_csrf.items() if exp > now]
        self.login_csrf = dict(live[-(MAX_LOGIN_FORMS - 1):])
        token = secrets.token_urlsafe(24)
        self.login_csrf[token] = now + 600
        return token

    def sign_in_wait_s(self) -> float:
        """Seconds until a sign-in may be tried again, after ``MAX_REFUSED_SIGN_INS`` refused
        ones in a window (0: now).  Nothing limited the guesses at the token before."""
        now = self.clock()
        self.refused_sign_ins = [at for at in self.refused_sign_ins if at > now - SIGN_IN_WINDOW_S]
        if len(self.refused_sign_ins) < MAX_REFUSED_SIGN_INS:
            return 0.0
        return self.refused_sign_ins[0] + SIGN_IN_WINDOW_S - now

    def sign_in_refused(self) -> None:
        self.refused_sign_ins.append(self.clock())


class FormTooLarge(ValueError):
    """A form over ``MAX_FORM_BYTES`` (413)."""


def _form(handler: BaseHTTPRequestHandler) -> dict[str, str]:
    text = (handler.headers.get("Content-Length") or "0").strip()
    if not text.isdigit():  # "-1" read until the client closed, past the form limit
        raise ValueError(f"Content-Length {text[:20]!r} is not a length")
    length = int(text)
    if length > MAX_FORM_BYTES:
        raise FormTooLarge("form too large")
    body = handler.rfile.read(length).decode("utf-8", errors="replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


def make_handler(console: Console) -> type[BaseHTTPRequestHandler]:
    from relay.console_routes import Routes

    class Handler(BaseHTTPRequestHandler):
        server_version = "outbox-relay-console"
        sys_version = ""
        timeout = REQUEST_TIMEOUT_S

        def end_headers(self) -> None:
            # Every response's: the pages', the redirects' (the sign-in's, which sets the
            # session cookie, among them) and the standard library's error pages (501, 414, 431).
            for name, value in HEADERS.items():
                self.send_header(name, value)
            super().end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
            console.log.debug("console_request", client=self.client_address[0], line=format % args)

        def _host_ok(self) -> bool:
            # One Host header, of this console: with two, only the first was checked.
            hosts = self.headers.get_all("Host") or []
            return len(hosts) == 1 and hosts[0] in console.hosts  # none allowed: none served

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
                console.log.warning("console_refused", client=self.client_address[0], path=self.path[:200],
                                    reason="host")
                self.send_page(HTTPStatus.MISDIRECTED_REQUEST, "unknown host", content_type="text/plain")
                return
            parts = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            with console.lock:
                Routes(console, self).get(unquote(parts.path), query)

        def do_POST(self) -> None:  # noqa: N802 - stdlib's name
            if not self._host_ok() or not self._origin_ok():
                console.log.warning("console_refused", client=self.client_address[0], path=self.path,
                                    reason="host_or_origin")
                self.send_page(HTTPStatus.FORBIDDEN, "cross-site request refused", content_type="text/plain")
                return
            try:
                form = _form(self)
            except FormTooLarge:
                self.send_page(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "form too large", content_type="text/plain")
                return
            except ValueError as exc:
                self.send_page(HTTPStatus.BAD_REQUEST, str(exc), content_type="text/plain")
                return
            with console.lock:
                Routes(console, self).post(urlsplit(self.path).path, form)

    return Handler


def _url_host(host: str) -> str:
    """The host as a URL and a Host header write it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


class _Server(ThreadingHTTPServer):
    """A thread per connection (a request is read there, and acted on under the console's
    lock); a request that fails (a client gone mid-answer) is one log line, not a traceback
    on stderr that any local client could repeat."""

    daemon_threads = True
    request_queue_size = MAX_CONNECTIONS  # the listen queue: 5 made the kernel hold back a burst
    log: Any = None
    busy_logged = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before, a thread for every connection however many: a client opening thousands
        # and trickling bytes grew the console by a thread and a socket each.
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            now = time.monotonic()
            if self.log is not None and now - self.busy_logged > 10:  # one line per 10 s of it
                self.busy_logged = now
                self.log.warning("console_busy", client=str(client_address[0]), connections=MAX_CONNECTIONS,
                                 hint="connections over the limit are closed unanswered")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if self.log is not None:
            self.log.warning("console_request_failed", client=str(client_address[0]),
                             error=f"{type(error).__name__}: {error}"[:200])


def _server_class(host: str) -> type[_Server]:
    """HTTPServer binds IPv4 only: --console-host ::1 failed ("Address family for hostname not
    supported") where --metrics-host ::1 works (relay/http.py chooses the family the same way)."""
    if ":" not in host:
        return _Server

    class ServerV6(_Server):
        address_family = socket.AF_INET6

    return ServerV6


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
    server.log = log
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
