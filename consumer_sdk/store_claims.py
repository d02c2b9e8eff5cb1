"""The claims of :class:`~consumer_sdk.store.PgInboxStore`: an inbox row inserted per event
(one, or a batch in one statement), the first with BEGIN in one round trip (the claim
prepared on the connection where it can), and the lookups of rows already committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import psycopg
import psycopg.abc
import psycopg.errors

from consumer_sdk import _wire
from consumer_sdk.model import Claim, InboxMessage
from consumer_sdk.store_connection import _PREPARED_LOSSES_MAX, CLAIM_STATEMENT
from consumer_sdk.store_transactions import StoreTransactions
from outbox_core.queries import query


def pipelined(conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]:
    """``conn.pipeline()`` (statements sent together, one round trip at its end), or, with a
    libpq older than 14 (no pipeline mode), a block that sends each statement at once: the
    same statements and answers, one round trip each."""
    return conn.pipeline() if psycopg.capabilities.has_pipeline() else nullcontext()


class StoreClaims(StoreTransactions):
    """Claims of inbox rows, and lookups."""

    def claim(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None) -> Claim:
        """Insert the inbox row; a conflicting row is a duplicate when its hash matches.

        As the transaction's first statement it goes in one simple query with BEGIN (and the
        deferred COMMIT before it), its parameters bound on the client: one round trip, and
        less client CPU than pipeline mode for one scalar statement."""
        key = {"consumer": consumer, "event_id": message.event_id}
        params = {**key, "payload_sha256": payload_sha256, "topic": message.topic,
                  "partition": message.partition, "offset": message.offset, "now": self._now()}
        conn = self._active
        with self.translated():
            if self._begun:
                row = conn.execute(query("inbox", "claim"), params).fetchone()
            else:
                row = self._first_claim(conn, params)
            if row is not None:
                return "new"
            found = conn.execute(query("inbox", "lookup"), key).fetchone()
        if found is None:  # deleted by retention between the two statements: it was applied
            return "duplicate"
        return "duplicate" if found[0] == payload_sha256 else "mismatch"

    def _first_claim(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> Any:
        """[COMMIT;] BEGIN; claim, in one round trip; returns the claim's row (None: a conflict).

        The prepared claim in one libpq pipeline where it can (see :mod:`consumer_sdk._wire`),
        else one simple query with the parameters bound on the client."""
        if self._claim_prepared(conn):
            return self._first_claim_prepared(conn, params)
        if self._client is None or self._client.connection is not conn:
            self._client = psycopg.ClientCursor(conn)
        cursor = self._client
        try:
            cursor.execute(self._prefix() + query("inbox", "claim"), params)
        except BaseException:
            self._first_failed()
            raise
        self._confirmed(cursor.statusmessage)  # the first result: COMMIT's (or BEGIN's)
        while cursor.nextset():
            pass
        return cursor.fetchone()

    def _claim_prepared(self, conn: psycopg.Connection[Any]) -> bool:
        """True when ``conn`` holds the prepared claim, preparing it when it can (never with a
        COMMIT deferred: its transaction is still open)."""
        if self._prepared_on is conn:
            return True
        if self._pending is not None or self._prepared_losses >= _PREPARED_LOSSES_MAX \
                or not _wire.available(conn):
            return False
        _wire.prepare(conn, query("inbox", "claim_prepare").encode())
        self._prepared_on = conn
        return True

    def _first_claim_prepared(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> Any:
        values = _claim_values(params)
        leading = (_wire.COMMIT, _wire.BEGIN) if self._pending is not None else (_wire.BEGIN,)
        try:
            results = _wire.send_before(conn, leading, CLAIM_STATEMENT, values)
            _wire.raise_first_error(conn, results[:len(leading)])
        except BaseException:
            self._first_failed()
            raise
        status = results[0].command_status
        self._confirmed(status.decode() if status is not None else None)
        claim = results[len(leading)]
        if _wire.failed(claim):
            try:
                _wire.raise_first_error(conn, [claim])
            except psycopg.errors.InvalidSqlStatementName:  # DISCARD ALL, or another server session
                conn.rollback()  # the transaction BEGIN opened, aborted by the claim
                self._begun = False
                self._prepared_on = None
                self._prepared_losses += 1
                return self._first_claim(conn, params)
        self._prepared_losses = 0
        return (True,) if claim.ntuples else None

    def claim_many(self, *, consumer: str, messages: Sequence[InboxMessage],
                   digests: Sequence[bytes | None]) -> list[Claim]:
        """:meth:`claim` for a batch of distinct events, in one statement (two when a
        concurrent transaction committed one of them meanwhile)."""
        if not messages:
            return []
        if len(messages) == 1:  # scalar parameters: cheaper to encode than five 1-element arrays
            return [self.claim(consumer=consumer, message=messages[0], payload_sha256=digests[0])]
        params = {"consumer": consumer, "event_ids": [m.event_id for m in messages], "hashes": list(digests),
                  "topics": [m.topic for m in messages], "partitions": [m.partition for m in messages],
                  "offsets": [m.offset for m in messages], "now": self._now()}
        conn = self._active
        with self.translated():
            if self._begun:
                cursor = conn.execute(query("inbox", "claim_batch"), params)
            else:
                cursor = self._first_in_pipeline(conn, query("inbox", "claim_batch"), params)
            claims: list[str] = [row[0] for row in cursor.fetchall()]
            unseen = [i for i, claim in enumerate(claims) if claim == "unseen"]
            if unseen:
                ids = [messages[i].event_id for i in unseen]
                found = dict(conn.execute(query("inbox", "lookup_batch"),
                                          {"consumer": consumer, "event_ids": ids}).fetchall())
                for i in unseen:  # absent: deleted by retention after it was applied
                    event_id = messages[i].event_id
                    claims[i] = "duplicate" if event_id not in found or found[event_id] == digests[i] \
                        else "mismatch"
        return cast("list[Claim]", claims)

    def _first_in_pipeline(self, conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> Any:
        """[COMMIT,] BEGIN and a statement with array parameters (sent in binary, which client
        binding cannot do) in one pipeline: one round trip (libpq < 14: one each)."""
        try:
            with pipelined(conn):
                commit = conn.execute(query("inbox", "commit")) if self._pending is not None else None
                conn.execute(query("inbox", "begin"))
                cursor = conn.execute(sql, params)
        except BaseException:
            self._first_failed()
            raise
        self._confirmed(commit.statusmessage if commit is not None else None)
        return cursor

    def applied_before(self, *, consumer: str, event_ids: Sequence[Any]) -> dict[Any, bytes | None]:
        """The committed inbox rows of these events (event id -> body hash), in one statement
        outside any transaction (the processor's duplicate check before a batch)."""
        if not event_ids:
            return {}
        if self._pending is not None:
            raise RuntimeError("applied_before() runs with no deferred COMMIT (sync() first)")
        conn = self.conn
        with self.translated():
            rows = conn.execute(query("inbox", "lookup_batch"),
                                {"consumer": consumer, "event_ids": list(event_ids)}).fetchall()
        return dict(rows)

    def unclaim(self, *, consumer: str, event_ids: Sequence[Any]) -> None:
        """Delete the rows this transaction claimed for records it will not apply after all."""
        if event_ids:
            self._flush()
            with self.translated():
                self._active.execute(query("inbox", "unclaim"),
                                     {"consumer": consumer, "event_ids": list(event_ids)})


def _claim_values(params: dict[str, Any]) -> list[bytes | None]:
    """A claim's parameters as the prepared claims take them: text, in their order."""
    digest, now = params["payload_sha256"], params["now"]
    return [params["consumer"].encode(), str(params["event_id"]).encode(),
            None if digest is None else b"\\x" + digest.hex().encode(), params["topic"].encode(),
            b"%d" % params["partition"], b"%d" % params["offset"],
            None if now is None else now.isoformat().encode()]
