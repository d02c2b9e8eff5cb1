"""The inbox in PostgreSQL: the :class:`~consumer_sdk.processor.InboxStore` adapter.

Only this module (with its parts, ``store_*.py``: see :mod:`consumer_sdk.store_connection`)
and :mod:`consumer_sdk.outbox` talk to psycopg.  The store owns
one connection in autocommit mode and opens each transaction in
:meth:`PgInboxStore.transaction` (BEGIN sent with its first statement), so
nothing commits outside one.  A transaction may end with its COMMIT deferred
(``defer_commit``): the COMMIT then goes in one round trip with the next
transaction's BEGIN and first statement, or with :meth:`PgInboxStore.sync`, and the
transaction's ``on_commit`` runs only once the server confirmed that COMMIT.  Driver errors are
translated here: an unreachable database or a broken connection is
:class:`DatabaseUnavailable`, an aborted transaction (serialization failure,
deadlock) :class:`TransactionConflict`, both retried by the consumer; a missing
table is :class:`SchemaMissing`.
"""

from __future__ import annotations

from consumer_sdk._pg import connect_factory as connect_factory  # the inbox's, re-exported
from consumer_sdk.errors import InboxGroupConflict, SchemaMissing
from consumer_sdk.store_claims import pipelined as pipelined
from consumer_sdk.store_connection import CLAIM_STATEMENT as CLAIM_STATEMENT
from consumer_sdk.store_connection import CLAIM_STRICT_STATEMENT as CLAIM_STRICT_STATEMENT
from consumer_sdk.store_connection import ConnectionFactory as ConnectionFactory
from consumer_sdk.store_trips import StoreTrips
from outbox_core.pooling import transaction_pooled
from outbox_core.queries import query


class PgInboxStore(StoreTrips):
    """The inbox on one owned connection.  Not thread-safe: one consumer loop uses it."""

    #: The handler's writes go through this transaction's connection and roll back with it:
    #: the processor needs no savepoint per message while nothing fails.
    handler_writes_roll_back = True

    def probe_pooler(self) -> bool:
        """True when this store's database is reached through a transaction pooler
        (:func:`outbox_core.pooling.transaction_pooled`, two short connections); psycopg's
        automatic preparing is then off for the store's connections from now on: its
        statement names are per client connection, and such a pooler shares server sessions
        between clients, so a name could be missing there, or hold another client's
        statement.  The inbox's own prepared statements are named per statement and stay."""
        with self.translated():
            pooled = transaction_pooled(self._connect)
        if pooled:
            self._auto_prepare = False
            if self._conn is not None:
                self._conn.prepare_threshold = None
        return pooled

    def check_schema(self) -> None:
        """Raise :class:`SchemaMissing` unless the inbox table exists."""
        with self.translated():
            row = self.conn.execute(query("inbox", "schema_check")).fetchone()
        if not row or not row[0]:
            raise SchemaMissing("the inbox table is missing: run `outbox-relay migrate` (0004_inbox)")

    def bind_group(self, *, consumer: str, group: str) -> None:
        """Record ``group`` as the inbox name's group at first use; raise
        :class:`InboxGroupConflict` when the name belongs to another group."""
        params = {"consumer": consumer, "group": group}
        with self.translated():
            self.conn.execute(query("inbox", "bind_group"), params)
            row = self.conn.execute(query("inbox", "bound_group"), params).fetchone()
        if row is not None and row[0] != group:
            raise InboxGroupConflict(
                f"inbox name {consumer!r} belongs to consumer group {row[0]!r}, not {group!r}: two groups on "
                "one inbox name would drop each other's events as duplicates; use another name (a new "
                "inbox) or the same group_id")

    # -- retention --------------------------------------------------------------------

    def cleanup_batch(self, *, consumer: str, retention_s: float, limit: int) -> int:
        """Delete up to ``limit`` of ``consumer``'s rows older than ``retention_s``; returns the count."""
        params = {"consumer": consumer, "retention_s": retention_s, "limit": limit, "now": self._now()}
        self.sync()  # never inside a deferred COMMIT's transaction
        conn = self.conn
        with self.translated(), conn.transaction():
            return conn.execute(query("inbox", "cleanup_batch"), params).rowcount


def cleanup_inbox(store: PgInboxStore, *, consumer: str, retention_s: float, batch: int = 1000,
                  max_batches: int = 100) -> int:
    """Retention in bounded batches (each its own short transaction); returns rows deleted.

    ``retention_s`` must exceed the redelivery horizon of the consumer's topics
    (their retention): a message redelivered after its inbox row is gone would be
    applied again.  :class:`~consumer_sdk.inbox.InboxConsumer` checks that at start.
    """
    total = 0
    for _ in range(max_batches):
        deleted = store.cleanup_batch(consumer=consumer, retention_s=retention_s, limit=batch)
        total += deleted
        if deleted < batch:
            break
    return total
