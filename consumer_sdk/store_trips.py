"""The one-trip transactions of :class:`~consumer_sdk.store.PgInboxStore`, for a statements
handler: BEGIN, the inbox row, the statements and COMMIT in one libpq pipeline, alone or
chained (sent ahead of their answers), and a batch's statements in one round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
import psycopg.abc
import psycopg.errors

from consumer_sdk import _wire
from consumer_sdk.model import InboxMessage
from consumer_sdk.store_claims import StoreClaims, _claim_values
from consumer_sdk.store_connection import _CHAIN, _PREPARED_LOSSES_MAX, CLAIM_STRICT_STATEMENT
from consumer_sdk.store_transactions import _check_committed
from outbox_core.queries import query


class StoreTrips(StoreClaims):
    """A statements handler's transactions in one round trip."""

    def claim_and_apply(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None,
                        statements: Sequence[tuple[Any, Any]]) -> bool | None:
        """A whole transaction in one round trip: BEGIN, the inbox row (``claim_strict``: a
        conflict fails it), ``statements`` (``(query, params)`` pairs, bound as a cursor binds
        them) and COMMIT, in one libpq pipeline with one Sync.  Runs between transactions,
        with no COMMIT deferred.

        True: committed.  False: nothing was written (the event was there already, a
        statement or the COMMIT failed, a statement could not be bound) and no transaction
        is left open; the caller takes the usual way, which says why.  None: this
        connection cannot take the path (no libpq pipeline mode, or psycopg's internals
        missing: :func:`consumer_sdk._wire.available`).  A broken connection is
        :class:`DatabaseUnavailable`: whether the COMMIT happened is unknown (a redelivery
        finds the inbox row if it did)."""
        if self._tx is not None or self._pending is not None:
            raise RuntimeError("claim_and_apply() runs between transactions, with no COMMIT deferred")
        with self.translated():
            conn = self.conn
        if not _wire.available(conn):
            return None
        with self.translated():
            strict = self._strict_prepared(conn)
        parts = self._trip(conn, consumer=consumer, message=message, payload_sha256=payload_sha256,
                           statements=statements, strict=strict)
        if parts is None:
            return False
        claim, steps = parts
        with self.translated():
            results = _wire.send_all(conn, [_wire.Step(_wire.BEGIN), claim, *steps, _wire.Step(_wire.COMMIT)])
            if _committed(results):
                if claim.prepared:
                    self._prepared_losses = 0
                return True
            self._note_strict_lost(results[1], conn)
            _wire.roll_back(conn)  # below psycopg: its rollback() would take the prepared claims along
        return False

    def _trip(self, conn: psycopg.Connection[Any], *, consumer: str, message: InboxMessage,
              payload_sha256: bytes | None, statements: Sequence[tuple[Any, Any]],
              strict: bool) -> tuple[_wire.Step, list[_wire.Step]] | None:
        """A one-trip transaction's inbox row (``claim_strict``, prepared by name when
        ``strict``) and its statements, bound as a cursor binds them; None when a statement
        cannot be bound (the handler's mistake: a wrong parameter count, a value with no
        dumper), raised again where the usual way runs the statements."""
        params = {"consumer": consumer, "event_id": message.event_id, "payload_sha256": payload_sha256,
                  "topic": message.topic, "partition": message.partition, "offset": message.offset,
                  "now": self._now()}
        try:
            binder = self._binder(conn)
            steps = [_wire.bind(conn, sql, args, transformer=binder) for sql, args in statements]
        except Exception:  # noqa: BLE001 - raised again where the usual way runs the statements
            return None
        if strict:
            return _wire.Step(CLAIM_STRICT_STATEMENT, _claim_values(params), prepared=True), steps
        return _wire.bind(conn, query("inbox", "claim_strict"), params, transformer=binder), steps

    def _note_strict_lost(self, claim: psycopg.pq.abc.PGresult, conn: psycopg.Connection[Any]) -> None:
        """The prepared ``claim_strict`` was not on the server (invalid_sql_statement_name:
        DISCARD ALL, or another server session): prepared again next time, a loss counted."""
        if self._strict_on is conn and claim.status == psycopg.pq.ExecStatus.FATAL_ERROR \
                and claim.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == b"26000":
            self._strict_on = None
            self._prepared_losses += 1

    def send_trip(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None,
                  statements: Sequence[tuple[Any, Any]]) -> bool | None:
        """:meth:`claim_and_apply`'s transaction, chained: sent without waiting for the answers
        to the transactions sent before it (:meth:`receive_trip` reads them, in order;
        :meth:`end_trips` ends the chain).  It begins with the ``chain`` statement, so that
        it commits only when the transaction sent before it committed (see inbox.sql).

        True: sent.  False: not sent (a statement could not be bound); the chain goes on.
        None: this store cannot chain (no pipeline mode, or a chain broke behind a pooler
        that does not keep a session's settings): the caller uses :meth:`claim_and_apply`."""
        trips = self._trips
        if trips is None:
            if self._tx is not None or self._pending is not None:
                raise RuntimeError("send_trip() runs between transactions, with no COMMIT deferred")
            if not self._chain_on:
                return None
            with self.translated():
                conn = self.conn
                if not _wire.available(conn):
                    return None
                strict = self._strict_prepared(conn)  # a PREPARE: before the pipeline opens
            trips = _wire.Trips(conn)
            self._chain_last = None
            self._chain_prev_ok = False
        else:
            conn = trips.conn
            strict = self._strict_on is conn
        parts = self._trip(conn, consumer=consumer, message=message, payload_sha256=payload_sha256,
                           statements=statements, strict=strict)
        if parts is None:
            return False
        claim, steps = parts
        self._chain_seq += 1
        mark = f"{self._chain_id}:{self._chain_seq}"
        after = self._chain_last
        chain = _wire.Step(_CHAIN, [None if after is None else after.encode(), mark.encode()])
        self._trips = trips
        with self.translated():
            trips.send([_wire.Step(_wire.BEGIN), chain, claim, *steps, _wire.Step(_wire.COMMIT)])
        self._chain_last = mark
        return True

    def receive_trip(self) -> bool:
        """Whether the oldest chained transaction not read yet committed.  False: nothing of
        it was written; every one sent after it fails too (read them, then :meth:`end_trips`)
        and goes the usual way, in order.  A broken connection is
        :class:`DatabaseUnavailable`: what committed is unknown (a redelivery finds it)."""
        trips = self._trips
        if trips is None or not len(trips):
            raise RuntimeError("receive_trip() without a chained transaction sent")
        with self.translated():
            results = trips.receive()
        prev_ok, self._chain_prev_ok = self._chain_prev_ok, False
        if _committed(results):
            self._chain_prev_ok = True
            if self._strict_on is trips.conn:  # through the prepared claim: a run of losses ends
                self._prepared_losses = 0
            return True
        if results[1].status == psycopg.pq.ExecStatus.FATAL_ERROR and prev_ok:
            # The one before committed, yet this one did not find its mark: the session's
            # setting did not carry over (a transaction pooler): one transaction at a time.
            self._chain_on = False
        else:
            self._note_strict_lost(results[2], trips.conn)
        return False

    def end_trips(self) -> None:
        """End a chain: read the answers not read yet, and roll back a failed transaction
        left open (below psycopg, as :meth:`claim_and_apply` does).  Idempotent."""
        trips, self._trips = self._trips, None
        if trips is None:
            return
        with self.translated():
            trips.close()
            _wire.roll_back(trips.conn)

    def can_pipeline(self) -> bool:
        """The open transaction's connection can take :meth:`execute_all`."""
        return _wire.available(self._active)

    def execute_all(self, statements: Sequence[tuple[Any, Any]]) -> None:
        """``statements`` (``(query, params)`` pairs, bound as a cursor binds them) in the open
        transaction, in one libpq pipeline with one Sync: one round trip.  The first failure
        is raised as psycopg raises it (the server skipped the rest; roll back to a
        savepoint, see :meth:`attempt`); a broken connection is :class:`DatabaseUnavailable`.
        Check :meth:`can_pipeline` first."""
        conn = self._active
        binder = self._binder(conn)
        steps = [_wire.bind(conn, sql, args, transformer=binder) for sql, args in statements]
        self._flush()
        with self.translated():  # driver errors only: a statement's error is a result here
            results = _wire.send_all(conn, steps)
        _wire.raise_first_error(conn, results)

    def _binder(self, conn: psycopg.Connection[Any]) -> psycopg.abc.Transformer:
        """The transformer that binds statements for ``conn``, kept while it is the store's
        connection (dropped by :meth:`reset`): it keeps the dumpers it found."""
        binder = self._transformer
        if binder is None or binder.connection is not conn:
            binder = self._transformer = _wire.transformer(conn)
        return binder

    def _strict_prepared(self, conn: psycopg.Connection[Any]) -> bool:
        """True when ``conn`` holds the prepared ``claim_strict``, preparing it when it can (as
        :meth:`_claim_prepared` does for the claim, under the same count of losses)."""
        if self._strict_on is conn:
            return True
        if self._prepared_losses >= _PREPARED_LOSSES_MAX:
            return False
        _wire.prepare(conn, query("inbox", "claim_strict_prepare").encode())
        self._strict_on = conn
        return True


def _committed(results: Sequence[psycopg.pq.abc.PGresult]) -> bool:
    """A one-trip transaction's results (its COMMIT's second to last, before the Sync's): True
    when every statement went through and the COMMIT committed."""
    if any(_wire.failed(result) for result in results):
        return False
    status = results[-2].command_status
    _check_committed(status.decode() if status is not None else None)
    return True
