"""One transaction of :class:`~consumer_sdk.processor.Processor`: the inbox rows claimed,
the handler called for each new record (in a savepoint, or none while nothing fails), the
outcomes counted and the records settled once the COMMIT is confirmed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from consumer_sdk.errors import HandlerTransactionFailed
from consumer_sdk.model import (
    BatchResult,
    Claim,
    InboxMessage,
    InvalidEventId,
    KafkaRecord,
    payload_sha256,
)
from consumer_sdk.processor_batches import ProcessorBatches
from consumer_sdk.processor_statements import ProcessorStatements
from consumer_sdk.rejections import Halt, message_of


class _HandlerFailed(Exception):
    def __init__(self, error: BaseException, index: int = 0) -> None:
        super().__init__(message_of(error))
        self.error = error
        self.index = index


class _Alone(Exception):
    """A handler with no savepoint failed: roll its whole transaction back.  ``index``: the
    failing record's position in the transaction (the records before it are applied again)."""

    def __init__(self, halt: Halt, index: int = 0) -> None:
        super().__init__(halt.reason)
        self.halt = halt
        self.index = index


class ProcessorTransactions(ProcessorStatements, ProcessorBatches):
    """One transaction: claims, handlers, counts, settling."""

    def _transaction(self, records: Sequence[KafkaRecord], result: BatchResult, *, attempt: int,
                     settle: bool = False, defer: bool = False) -> tuple[int, Halt | None]:
        """Apply records until one halts; commit what came before it.  Returns (count, halt).

        Once the commit is confirmed (at once, or with the next transaction's first round trip
        when ``defer``), the counts are taken and, with ``settle``, those records settled."""
        scans = [self._scan(record) for record in records]
        ids = [event_id for event_id, _ in scans if not isinstance(event_id, InvalidEventId)]
        batched = bool(ids) and len(set(ids)) == len(ids)
        applied: Counter[str] = Counter()
        duplicates: Counter[str] = Counter()
        halt: Halt | None = None
        settled = 0
        known = [self._known_duplicate(record, *scan) for record, scan in zip(records, scans, strict=True)] \
            if batched and self._known else [False] * len(records)

        def committed() -> None:  # true only now that the transaction committed
            self._count(applied, duplicates, result)
            if settle:
                self._settle(records[:settled], result)

        if all(known):  # redelivered, every one: nothing to claim, apply or commit
            duplicates.update(record.topic for record in records)
            settled = len(records)
            self._after_commits(committed)
            return settled, None
        prepared = [self._prepare(record) for record in records]
        valid = [m for m in prepared if isinstance(m, InboxMessage)]
        try:
            if self._deferring:
                with self._store.transaction(on_commit=committed,  # type: ignore[call-arg]
                                             defer_commit=defer) as conn:
                    settled, halt = self._apply(conn, records, prepared, valid, batched, known, result,
                                                applied, duplicates, attempt)
            else:
                with self._store.transaction() as conn:
                    settled, halt = self._apply(conn, records, prepared, valid, batched, known, result,
                                                applied, duplicates, attempt)
                committed()
        except _Alone as alone:  # a handler failed: the whole transaction rolled back
            if alone.index == 0:
                return 0, alone.halt
            # The records before it went well: apply them again, in a transaction of their own.
            settled, halt = self._transaction(records[:alone.index], result, attempt=attempt,
                                              settle=settle, defer=defer)
            return settled, halt if halt is not None else alone.halt
        return settled, halt

    def _one(self, record: KafkaRecord, result: BatchResult, *, defer: bool) -> tuple[int, Halt | None]:
        """:meth:`_transaction` of one record (``settle``, first attempt), without its batch
        machinery: one message at a time spends its client CPU in the driver, not here.

        The same steps in the same transaction: the claim, then the handler when the event is
        new (no savepoint: its failure rolls the transaction back); the counts are taken and
        the record settled once the COMMIT is confirmed.  A duplicate found by the lookup
        settles after the deferred COMMIT before it, with no transaction.  What this path does
        not cover (an invalid event id, a store that commits at once) goes through
        :meth:`_transaction`."""
        event_id, replayed = self._scan(record)
        if isinstance(event_id, InvalidEventId) or not self._deferring:
            return self._transaction([record], result, attempt=1, settle=True, defer=defer)
        if self._known and self._known_duplicate(record, event_id, replayed):
            def dropped() -> None:  # redelivered: nothing to claim, apply or commit
                self._dropped[record.topic] += 1
                result.duplicates += 1
                self._settle((record,), result)

            self._after_commits(dropped)
            return 1, None
        message = self._prepare(record)
        assert isinstance(message, InboxMessage)
        if self._statements is not None:
            if self._one_trip(record, message, result):
                return 1, None
            # Nothing written: the usual way says why (a duplicate, the statement's error).
            return self._transaction([record], result, attempt=1, settle=True)
        claim: Claim | None = None
        halt: Halt | None = None

        def committed() -> None:  # true only now that the transaction committed
            if halt is not None:
                return
            if claim == "new":
                self._applied[record.topic] += 1
                result.applied += 1
            elif claim == "duplicate":
                self._dropped[record.topic] += 1
                result.duplicates += 1
            self._settle((record,), result)

        try:
            with self._store.transaction(on_commit=committed, defer_commit=defer) as conn:  # type: ignore[call-arg]
                claim = self._store.claim(consumer=self.consumer, message=message,
                                          payload_sha256=payload_sha256(message.value))
                if claim == "new":
                    try:
                        self._call(conn, message)
                    except _HandlerFailed as failed:
                        self._rejections.handler_failed(record, failed.error, 1, result)
                        raise _Alone(Halt(failed.error, "handler_error", stop=False)) from failed
                elif claim == "duplicate":
                    self._lookup_pays = True  # a redelivery: look duplicates up before the next poll
                else:
                    halt = self._rejections.mismatch(record, message, result)
        except _Alone as alone:  # the handler failed: its transaction rolled back
            return 0, alone.halt
        return (0, halt) if halt is not None else (1, None)

    def _apply(self, conn: Any, records: Sequence[KafkaRecord], prepared: Sequence[InboxMessage | InvalidEventId],
               valid: Sequence[InboxMessage], batched: bool, known: Sequence[bool], result: BatchResult,
               applied: Counter[str], duplicates: Counter[str], attempt: int) -> tuple[int, Halt | None]:
        """The body of :meth:`_transaction`'s transaction (``known``: duplicates found before it)."""
        halt: Halt | None = None
        settled = 0
        claims: list[Claim | None] = [None] * len(records)
        if batched:
            unknown = [m for m, k in zip(prepared, known, strict=True) if isinstance(m, InboxMessage) and not k]
            found = iter(self._store.claim_many(consumer=self.consumer, messages=unknown,
                                                digests=[payload_sha256(m.value) for m in unknown]))
            claims = [None if not isinstance(m, InboxMessage) else "duplicate" if k else next(found)
                      for m, k in zip(prepared, known, strict=True)]
            if not self._lookup_pays and "duplicate" in claims:
                self._lookup_pays = True  # a redelivery: look duplicates up before the next batch
        # No savepoint: a handler failure rolls back everything (see _Alone).
        alone = batched and (len(records) == 1 or self._optimistic)
        if batched and len(valid) == len(records) > 1 and (
                (self._batch_handler is not None and self._apply_batch(conn, valid, claims))
                or (self._batch_statements is not None and self._apply_statements(valid, claims))):
            for record, claim in zip(records, claims, strict=True):
                (applied if claim == "new" else duplicates)[record.topic] += 1
            return len(records), None
        for index, record in enumerate(records):
            try:
                halt = self._step(conn, record, prepared[index], claims[index], result, applied,
                                  duplicates, attempt, alone=alone)
            except _Alone as failed:
                failed.index = index
                raise
            if halt is not None:
                if batched:  # the rows of the records from here on were claimed for nothing
                    self._store.unclaim(consumer=self.consumer, event_ids=[
                        m.event_id for m, c in zip(prepared[index:], claims[index:], strict=True)
                        if c == "new" and isinstance(m, InboxMessage)])
                break
            settled += 1
        return settled, halt

    def _step(self, conn: Any, record: KafkaRecord, prepared: InboxMessage | InvalidEventId,
              claim: Claim | None, result: BatchResult, applied: Counter[str], duplicates: Counter[str],
              attempt: int, *, alone: bool = False) -> Halt | None:
        if id(record) in self._rejections.judged:  # dead-lettered or skipped in a transaction rolled back since
            return None
        if isinstance(prepared, InvalidEventId):
            return self._rejections.invalid(record, prepared, result)
        message = prepared
        try:
            if claim is None:  # claimed here, in the record's savepoint
                with self._store.attempt():
                    claim = self._store.claim(consumer=self.consumer, message=message,
                                              payload_sha256=payload_sha256(message.value))
                    if claim == "new":
                        self._call(conn, message)
            elif claim == "new" and alone:
                self._call(conn, message)
            elif claim == "new":
                with self._store.attempt():
                    self._call(conn, message)
        except _HandlerFailed as failed:
            self._rejections.handler_failed(record, failed.error, attempt, result)
            halt = Halt(failed.error, "handler_error", stop=False)
            if alone and claim == "new":
                raise _Alone(halt) from failed
            return halt
        if claim == "new":
            applied[record.topic] += 1
        elif claim == "duplicate":
            duplicates[record.topic] += 1
        else:
            return self._rejections.mismatch(record, message, result)
        return None

    def _call(self, conn: Any, message: InboxMessage) -> None:
        try:
            self._handler(conn, message)
        except Exception as exc:  # noqa: BLE001 - every handler error is the policy's to judge
            failure = self._database_failure(exc)
            if failure is not None:
                # The database failed under the handler (a lost connection, a read-only
                # database, a pooler's lost statement) or aborted its transaction (class 40),
                # not the handler: the batch is retried whole with the database back-off, no
                # attempt counted, never dead-lettered.
                raise failure from exc
            raise _HandlerFailed(exc) from exc
        if self._store.in_failed_transaction():  # the handler caught a database error and carried on
            failure = self._transaction_failed()
            if not isinstance(failure, HandlerTransactionFailed):
                raise failure  # the database's doing (a deadlock, read-only): as if not caught
            raise _HandlerFailed(failure)
