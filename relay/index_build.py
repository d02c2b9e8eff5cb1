"""A CREATE INDEX CONCURRENTLY of migrate's on a live table (the outbox's claim index,
relay/migrate_index.py; an adopted Debezium table's, relay/adopt_index.py), without holding
the application's writers and without waiting on anything for ever.

The build runs outside a transaction on a connection of its own, the role's
``statement_timeout`` and ``lock_timeout`` lifted at its start (:func:`build_dsn`): they are
meant for the application's statements, and a 50 ms one cancelled every build.  It waits
for the transactions older than it instead of holding writers; a watch on another connection
(:class:`_Watch`) reads its progress: every :data:`WAIT_LOG_S` of waiting it logs
``migration_lock_wait``, and past ``wait_s`` (``--index-wait-s``) it cancels the build, and
migrate exits 6 naming the sessions waited for.  A build that did not finish leaves an invalid
index (PostgreSQL's way), which the next run drops and builds again.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay import db
from relay.errors import RelayError
from relay.migrate_steps import MigrationBlocked, MigrationCancelled, Step, sessions
from relay.queries import query

#: Start-up options of a concurrent build's own connection: a role's or database's timeouts,
#: meant for the application's statements, lifted as migrate's transactions lift them
#: (admin.sql, migration_lifts_timeouts); the watch bounds the build's waits instead.
BUILD_OPTIONS = "-c statement_timeout=0 -c lock_timeout=0"
#: A concurrent build waiting for older transactions logs migration_lock_wait this often.
WAIT_LOG_S = 30.0


def build_concurrently(conn: psycopg.Connection[Any], dsn: str, statement: sql.Composed, *, table: str,
                       index: str, step: Step, wait_s: float, log: Any) -> None:
    """``statement``, a CREATE INDEX CONCURRENTLY of ``index`` on ``table`` (a name
    ``to_regclass`` finds), run with empty parameters outside a transaction, its waits
    watched; ``step`` names it in errors and logs.  ``conn``, migrate's, idle (a transaction
    of its would be waited for), runs it only when the build's own connection cannot be
    opened; its autocommit is as it was after."""
    builder = _build_connection(dsn)
    runner = builder or conn
    watch = _Watch(dsn, runner, table=table, step=step, wait_s=wait_s, log=log)
    autocommit = conn.autocommit
    conn.autocommit = True
    try:
        with watch:
            runner.execute(statement, {})
    except psycopg.errors.QueryCanceled as exc:
        if watch.waited_for is not None:
            raise MigrationBlocked(
                f"{step.what} (CREATE INDEX CONCURRENTLY {index}, which never holds writers) waited "
                f"{wait_s:g} s for older transactions to end: "
                f"{sessions(watch.waited_for)}. End them or let them finish, then run migrate again (it "
                f"drops the build left unfinished and builds it again; --index-wait-s waits longer)") from None
        raise MigrationCancelled(
            f"{step.what} (CREATE INDEX CONCURRENTLY {index}) was cancelled "
            f"({exc.diag.message_primary or exc}); the unfinished index is dropped and built again by the "
            f"next run. Let it run (a statement_timeout: migrate lifts the role's on the build's own "
            f"connection with the start-up option -c statement_timeout=0, which a pooler in the way may "
            f"drop or refuse; run it without the pooler), then run migrate again") from None
    except psycopg.errors.LockNotAvailable as exc:
        raise MigrationBlocked(
            f"{step.what} (CREATE INDEX CONCURRENTLY {index}) gave up waiting for older transactions "
            f"({exc.diag.message_primary or exc}: a lock_timeout of the role or the database, which migrate "
            f"lifts on the build's own connection with a start-up option a pooler in the way may drop or "
            f"refuse); the unfinished index is dropped and built again by the next run. Run migrate again "
            f"once they ended, or without the pooler") from None
    finally:
        conn.autocommit = autocommit
        if builder is not None:
            builder.close()


def build_dsn(dsn: str) -> str:
    """``dsn`` with :data:`BUILD_OPTIONS` after its own ``options`` (or PGOPTIONS, which an
    ``options`` in the DSN would otherwise replace)."""
    own = conninfo_to_dict(dsn).get("options") or os.environ.get("PGOPTIONS")
    return make_conninfo(dsn, options=f"{own} {BUILD_OPTIONS}" if own else BUILD_OPTIONS)


def _build_connection(dsn: str) -> psycopg.Connection[Any] | None:
    """A concurrent build's own connection (:func:`build_dsn`).  Not a ``SET`` on migrate's
    connection: outside a transaction, through a transaction pooler, that would stay on a
    server connection the application gets next.  None when it cannot be opened (a pooler
    refusing start-up options): the build runs on migrate's connection, under the role's
    timeouts."""
    try:
        return db.connect(build_dsn(dsn), application_name="outbox-relay-migrate", prepare=False)
    except RelayError:
        return None


class _Watch:
    """A concurrent build's waits, read on a connection of its own (every 0.5 s, or a tenth of
    ``wait_s`` if less): every :data:`WAIT_LOG_S` of waiting (a third of ``wait_s`` if less)
    logs ``migration_lock_wait``; past ``wait_s`` of waiting in all the build is cancelled,
    the sessions it waited for in :attr:`waited_for`.  A watch that cannot read leaves the
    build alone."""

    def __init__(self, dsn: str, builder: psycopg.Connection[Any], *, table: str, step: Step, wait_s: float,
                 log: Any) -> None:
        self.dsn, self.builder, self.table, self.step, self.log = dsn, builder, table, step, log
        self.wait_s = wait_s
        self.waited_for: list[tuple[Any, ...]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="migrate-index-watch", daemon=True)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        every, warn_every = max(0.02, min(0.5, self.wait_s / 10)), min(WAIT_LOG_S, self.wait_s / 3)
        try:
            with db.connect(self.dsn, application_name="outbox-relay-migrate", prepare=False) as conn:
                waited, warned, last = 0.0, 0, time.monotonic()
                while not self._stop.wait(every):
                    now = time.monotonic()
                    row = conn.execute(query("admin", "index_build_progress"), {"table": self.table}).fetchone()
                    if row is None or not str(row[1]).startswith("waiting"):
                        last = now
                        continue
                    waited, last = waited + (now - last), now
                    if waited >= (warned + 1) * warn_every and waited < self.wait_s:
                        warned += 1
                        if self.log is not None:
                            self.log.warning("migration_lock_wait", version=None, name=self.step.name,
                                             attempt=warned, waited_s=round(waited, 1), wait_s=self.wait_s,
                                             phase=row[1], waiting_for_pid=row[2] or None)
                    if waited >= self.wait_s:
                        self.waited_for = conn.execute(query("admin", "index_build_blockers"),
                                                       {"builder": row[0], "locker": row[2] or 0}).fetchall()
                        self.builder.cancel_safe()
                        return
        except psycopg.Error:
            return
