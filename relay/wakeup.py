"""LISTEN/NOTIFY and the wake-up lock: how an idle relay sleeps and is woken (an adapter).

One connection of its own (``outbox-relay-listen``), used only by the loop's thread.
Asleep, the relay holds a session advisory lock on it; while some relay holds that
lock, writers NOTIFY on the outbox channel (sql/migrations/0003_notify.sql), and the
sleeping relay waits on the connection's socket.  Awake, nobody holds the lock and
writers pay nothing.  The loop (relay/loop.py) decides when to sleep and wake; this
module only talks to PostgreSQL.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import Any

import psycopg

from relay.queries import query
from relay.store import connect, translated

NOTIFY_CHANNEL = "outbox_relay"


class Wakeup:
    """The LISTEN connection and the wake-up lock.  Owned by the loop's thread; not thread-safe."""

    def __init__(self, dsn: str, *, application_name: str = "outbox-relay-listen",
                 on_statement: Callable[[], None] = lambda: None) -> None:
        self._dsn = dsn
        self._application_name = application_name[:63]
        self._on_statement = on_statement
        self._conn: psycopg.Connection[Any] | None = None
        self.queries = 0  # statements sent, for the idle-cost figures
        self.sleeping = False  # holds the wake-up lock on the LISTEN connection

    def set_sleeping(self, sleeping: bool) -> bool:
        """Take (True) or release (False) the wake-up lock on the LISTEN connection.

        While a relay holds it, writers NOTIFY (sql/migrations/0003_notify.sql).
        Returns whether this relay now holds it.  A broken connection loses it.
        """
        with translated():
            try:
                listen = self._listening()
                self._count()
                if sleeping:
                    row = listen.execute(query("relay", "go_to_sleep")).fetchone()
                    self.sleeping = bool(row and row[0])
                else:
                    listen.execute(query("relay", "wake_up"))
                    self.sleeping = False
                return self.sleeping
            except (psycopg.OperationalError, psycopg.InterfaceError):
                self.close()
                raise

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a NOTIFY on the outbox channel.

        Returns True when one arrived.  A broken listening connection is reopened
        on the next call; meanwhile the caller's poll keeps working.
        """
        with translated():
            try:
                listen = self._listening()
                # Anything already buffered counts; then wait on the socket.
                if any(True for _ in listen.notifies(timeout=0)):
                    return True
                ready, _, _ = select.select([listen.fileno()], [], [], max(0.0, timeout_s))
                if not ready:
                    return False
                return any(True for _ in listen.notifies(timeout=0))
            except (psycopg.OperationalError, psycopg.InterfaceError, OSError):
                self.close()
                time.sleep(min(timeout_s, 0.5))
                return False

    def close(self) -> None:
        """Drop the connection (the session lock goes with it).  Idempotent; the next
        call reconnects."""
        self.sleeping = False
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None

    def _listening(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._dsn, application_name=self._application_name)
            self._count()
            self._conn.execute(query("relay", "listen"))
        return self._conn

    def _count(self) -> None:
        self.queries += 1
        self._on_statement()
