"""Is a DSN reached through a transaction pooler?  (PgBouncer ``pool_mode=transaction``.)

The relay refuses to run there (it keeps session state on purpose: LISTEN, a session
advisory lock, ``synchronous_commit = off``).  The consumer SDK runs there, but not with
psycopg's automatic prepared statements: psycopg names them ``_pg3_0``, ``_pg3_1``, ... per
client connection, and a pooler without prepared-statement support (PgBouncer before
1.21, or ``max_prepared_statements = 0``) shares server sessions between clients, so the
name a statement was prepared under on one server can be missing on the next, or hold
another client's statement there, which then runs with this one's parameters.

PgBouncer's ``pool_mode=statement`` refuses the probe's transaction block: a pooler too.

The probe: connection A asks for its server process and ends its transaction; connection
B then holds a transaction and asks for its own.  Directly connected, B's differs from
A's and A keeps its own.  A pooler that handed A's server to B (PgBouncer reuses the
last one released), or that moves A to another server while B holds one, is a
transaction pooler.  A session-mode pool passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from outbox_core.queries import query


def transaction_pooled(connect: Callable[[], Any]) -> bool:
    """Probe with two connections from ``connect`` (autocommit psycopg connections; both
    closed here).  Driver errors propagate."""
    first = connect()
    try:
        second = connect()
        try:
            pid_a = _backend_pid(first)
            try:
                with second.transaction():
                    return bool(_backend_pid(second) == pid_a or _backend_pid(first) != pid_a)
            except Exception as exc:
                # PgBouncer's statement mode refuses any transaction block: a pooler too.  The
                # relay waited for it for ever as for a database that is down (an audit).
                if "statement pooling mode" in str(exc):
                    return True
                raise
        finally:
            second.close()
    finally:
        first.close()


def _backend_pid(conn: Any) -> int:
    row = conn.execute(query("relay", "backend_pid")).fetchone()
    assert row is not None
    return int(row[0])
