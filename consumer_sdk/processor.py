"""The core of the dedup consumer: settle records exactly once in effect.

First, one statement outside any transaction reads the inbox rows already committed for
the records' events: a record found with its body's hash is a duplicate, settled without a
transaction (a redelivered batch costs that one statement).  Then, for each batch, one
database transaction: the rest of the batch's inbox rows are inserted in one statement
(``(consumer, event_id)`` ``ON CONFLICT DO NOTHING``, which says for each record whether
it is new, a duplicate or a mismatch), then the handler is called, with the same
connection, for each new record.  With a store whose transaction carries the handler's
writes (``handler_writes_roll_back``, the PostgreSQL one), no savepoint is set while
nothing fails: one round trip per message less (unless ``savepoint_per_message``).  The
guarantees kept here:

* The inbox row and the handler's writes commit together or not at all, so a
  redelivered event finds its row and is dropped (counted as a duplicate).
* A record is *settled* (its offset may be committed) only after the transaction
  that applied it committed, or after it was durably dead-lettered or skipped.
  ``on_settled`` is called with each settled prefix, in order, so offsets never
  run ahead of the database.  With a store that can defer a COMMIT (``sync``), the
  transactions of one call but the last send their COMMIT with the next one's first
  round trip; their records are settled when the server confirmed it, and not at all
  when that round trip failed (a redelivery finds their rows if they did commit).
* A handler failure rolls back only its own savepoint, and the inbox rows of the records
  from it on are deleted again before the commit: the records before it commit (their
  handlers ran once), the failing record is retried alone (its own transaction per
  attempt, with back-off), and the records after it are processed afterwards, in order.
  Nothing is lost and nothing applied twice, and per-partition order holds.
* Without savepoints (``handler_writes_roll_back``), a handler failure rolls the whole
  transaction back instead, and the records before the failing one are applied again in
  a transaction of their own: their handlers run a second time (the first run's writes
  were rolled back), as after a failed batch handler.  The failure counts as the failing
  record's first attempt, and a record dead-lettered or skipped by policy before it is
  not sent or counted again.  The rest is as above.
* A policy that says ``stop`` raises :class:`ConsumerStopped` after the records
  before the offending one were committed and settled.

A batch handler (``batch_handler``) is called once with every new record of the batch
instead (in one savepoint); when it raises, that savepoint rolls back and the batch goes
one record at a time (``batch_handler(conn, [message])``), with the rules above.  A batch
that carries one event id twice claims record by record inside the savepoints.

A statements handler (``statements``) returns the statements that apply a message instead
of running them.  One at a time, the claim, those statements and the COMMIT go in one
round trip (``PgInboxStore.claim_and_apply``), chained: the transactions of a call's
messages are sent ahead of their answers, each committing only when the one before it
did (``send_trip``, :meth:`Processor._chain`).  In a batch the statements of all its
new messages go in one round trip, in a savepoint (``execute_all``).  Whenever that writes nothing or
rolls back, the records go the handler's way, the statements executed one by one, under
every rule above.

This module depends on two small protocols only (:class:`InboxStore`,
:class:`~consumer_sdk.rejections.DeadLetterSink`); the PostgreSQL and Kafka adapters and
the in-memory fakes of :mod:`consumer_sdk.testing` implement them.  What happens to a
record that is not applied (dead letter, skip, stop) is :mod:`consumer_sdk.rejections`.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from consumer_sdk.errors import (
    DatabaseUnavailable,
    DeadLetterBlocked,
    HandlerTransactionFailed,
    PermanentError,
)
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import (
    BatchResult,
    Claim,
    DeadLetter,
    InboxMessage,
    InvalidEventId,
    KafkaRecord,
    payload_sha256,
    scan_event_id,
    to_message,
)
from consumer_sdk.rejections import DeadLetterSink as DeadLetterSink
from consumer_sdk.rejections import Halt, Rejections, describe, message_of
from consumer_sdk.rejections import Policies as Policies
from consumer_sdk.replays import REPLAY_HEADER

#: A handler: apply one message with the given connection, inside the consumer's
#: transaction.  It must not commit.  Raising rolls back its writes; raising
#: :class:`~consumer_sdk.errors.PermanentError` skips the retries.
Handler = Callable[[Any, InboxMessage], None]

#: A batch handler: apply several new messages at once (one statement for all, say), with
#: the given connection, inside the consumer's transaction.  Same rules as a handler; when
#: it raises, the batch is rolled back and its messages applied one at a time
#: (``batch_handler(conn, [message])``, each in its own savepoint), so that a failure
#: concerns its own message only.
BatchHandler = Callable[[Any, Sequence[InboxMessage]], None]
#: A statements handler: the statements that apply one message, as ``(query, params)``
#: pairs, computed from the message alone (it may be called more than once for one
#: message; nothing it does outside the database is undone).  One at a time, the claim,
#: these statements and the COMMIT go to the server in one round trip
#: (:meth:`consumer_sdk.store.PgInboxStore.claim_and_apply`); anywhere else, and whenever
#: that trip fails, the statements are executed as a handler would execute them.
StatementsHandler = Callable[[InboxMessage], Sequence[tuple[Any, Any]]]

_ABSENT = object()
#: One at a time, how many of a statements handler's transactions are sent ahead of their
#: answers (see Processor._chain).  A failure sends those after it the usual way again.
CHAIN_DEPTH = 16


class InboxStore(Protocol):
    """Where the inbox lives; the transaction also carries the handler's writes."""

    def transaction(self) -> AbstractContextManager[Any]:
        """A transaction; yields the connection handed to handlers.  Commits on a clean exit."""

    def attempt(self) -> AbstractContextManager[None]:
        """A savepoint inside :meth:`transaction`: rolled back (and the error re-raised) on an exception."""

    def claim(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None) -> Claim:
        """Insert the inbox row if absent; say whether it was new, a duplicate or a mismatch."""

    def claim_many(self, *, consumer: str, messages: Sequence[InboxMessage],
                   digests: Sequence[bytes | None]) -> list[Claim]:
        """:meth:`claim` for distinct events at once, in order."""

    def unclaim(self, *, consumer: str, event_ids: Sequence[Any]) -> None:
        """Delete inbox rows this transaction inserted for records it will not apply."""

    def in_failed_transaction(self) -> bool:
        """True when the current transaction can no longer commit (a swallowed database error)."""


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


class Processor:
    """Settles records for one logical consumer.  Not thread-safe: one caller at a time."""

    def __init__(self, *, consumer: str, store: InboxStore, handler: Handler | None,
                 dead_letters: DeadLetterSink, policies: Policies, metrics: ConsumerMetrics,
                 log: Any, sleep: Callable[[float], None],
                 on_settled: Callable[[Sequence[KafkaRecord]], None], batch_size: int | None = None,
                 batch_handler: BatchHandler | None = None, savepoint_per_message: bool = False,
                 statements: StatementsHandler | None = None) -> None:
        self.consumer = consumer
        self._batch_size = batch_size  # records per transaction (None: all that process() gets)
        self._store = store
        self._batch_handler = batch_handler
        if sum(h is not None for h in (handler, batch_handler, statements)) != 1:
            raise TypeError("give one of a handler, a batch_handler or a statements handler")
        if statements is not None:
            handler = _executing(statements)
        elif handler is None:
            assert batch_handler is not None
            handler = _one_of(batch_handler)
        self._handler = handler
        # One at a time, a statements handler's transaction goes in one round trip when the
        # store can send it so (PgInboxStore.claim_and_apply); in a batch, the statements of
        # all its new messages go in one (PgInboxStore.execute_all).
        self._statements = statements if callable(getattr(store, "claim_and_apply", None)) else None
        self._chained = self._statements is not None and callable(getattr(store, "send_trip", None))
        self._batch_statements = statements if callable(getattr(store, "execute_all", None)) else None
        self._rejections = Rejections(consumer=consumer, dead_letters=dead_letters, policies=policies,
                                      metrics=metrics, log=log)
        self._policies = policies
        self._metrics = metrics
        self._log = log
        self._sleep = sleep
        self._on_settled = on_settled
        self._known: dict[Any, bytes | None] = {}  # of the current process() call
        self._lookup_pays = True  # the last lookup found duplicates, or a claim met one since
        self._prepared: dict[int, InboxMessage | InvalidEventId] = {}  # id(record) -> message, idem
        # id(record) -> (event id or why not, replayed): parsed once a process() call; a message
        # is built only for the records that go into a transaction (not for known duplicates)
        self._scanned: dict[int, tuple[uuid.UUID | InvalidEventId, bool]] = {}
        # A store that can defer a COMMIT to the next transaction's first round trip (see
        # PgInboxStore.transaction): one round trip less per transaction, one at a time.
        self._deferring = callable(getattr(store, "sync", None))
        self._applied: Counter[str] = Counter()  # committed in this process() call, for the metrics
        self._dropped: Counter[str] = Counter()
        # No savepoint per message while nothing fails: the store's transaction carries the
        # handler's writes, so a failure can roll everything back (see _Alone).
        self._optimistic = bool(getattr(store, "handler_writes_roll_back", False)) and not savepoint_per_message

    def process(self, records: Sequence[KafkaRecord], result: BatchResult | None = None) -> BatchResult:
        """Settle ``records`` in order; returns what happened (added to ``result`` when given,
        so that the counts of a call interrupted by an exception are not lost).

        Errors of the store, the dead-letter sink or ``sleep`` propagate: the records
        not yet passed to ``on_settled`` are unsettled and must be processed again.
        """
        result = result if result is not None else BatchResult()
        rest = list(records)
        self._scanned = {id(record): scan_event_id(record, REPLAY_HEADER) for record in rest}
        try:
            self._known = self._applied_before(rest)
            self._settle_all(rest, result)
            self._sync()
        except BaseException:
            self._sync_quietly()
            raise
        finally:
            self._prepared = {}
            self._scanned = {}
            self._known = {}
            self._rejections.judged.clear()
            self._publish_counts()
        return result

    def _settle_all(self, records: list[KafkaRecord], result: BatchResult) -> None:
        """Transactions of ``batch_size`` records, in order; each one's COMMIT deferred to the
        next one's first round trip while more follow (``on_settled`` once it is confirmed)."""
        done, total = 0, len(records)
        step = total if self._batch_size is None else self._batch_size
        while done < total:
            if step == 1 and self._chained:
                settled, failed = self._chain(records, done, result)
                done += settled
                if failed:  # nothing of it written: the usual way says why
                    settled, halt = self._transaction([records[done]], result, attempt=1, settle=True)
                elif done < total:
                    settled, halt = self._one(records[done], result, defer=done + 1 < total)
                else:
                    break
            elif step == 1:
                settled, halt = self._one(records[done], result, defer=done + 1 < total)
            else:
                chunk = records[done:done + step]
                settled, halt = self._transaction(chunk, result, attempt=1, settle=True,
                                                  defer=done + len(chunk) < total)
            done += settled
            if halt is None:
                continue
            self._sync()  # the records before the halt are settled before anything else happens
            if halt.blocked:
                assert isinstance(halt.error, DeadLetterBlocked)
                raise halt.error
            if halt.stop:
                raise self._rejections.stopped(records[done], halt)
            self._retry_alone(records[done], halt.error, result)
            self._settle(records[done:done + 1], result)
            done += 1

    def _sync(self) -> None:
        if self._deferring:
            self._store.sync()  # type: ignore[attr-defined]

    def _sync_quietly(self) -> None:
        """On the way out with an error: commit a deferred COMMIT (its transaction completed),
        or roll it back when even that fails; the error in flight is the one reported."""
        if not self._deferring or not self._store.commit_pending:  # type: ignore[attr-defined]
            return
        try:
            self._store.sync()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - its records stay unsettled; the original error propagates
            self._store.discard()  # type: ignore[attr-defined]

    def _publish_counts(self) -> None:
        """The metrics and the log line of what this process() call committed (once, not per message)."""
        for topic, n in self._applied.items():
            self._metrics.processed.labels(self.consumer, topic).inc(n)
        for topic, n in self._dropped.items():
            self._metrics.duplicates.labels(self.consumer, topic).inc(n)
        if self._dropped:
            self._log.debug("duplicate_dropped", count=sum(self._dropped.values()), topics=dict(self._dropped))
        self._applied.clear()
        self._dropped.clear()

    def _applied_before(self, records: Sequence[KafkaRecord]) -> dict[Any, bytes | None]:
        """The inbox rows already committed for these records' events (event id -> body hash),
        read in one statement before any transaction: a redelivered record found here with
        its body's hash is a duplicate without a claim, a savepoint or a transaction.  A row
        committed is final, so the answer cannot go stale; what is not found (or differs) is
        claimed as before, in the transaction.  Records of replays are left out (their inbox
        key is not the consumer's name, see :mod:`consumer_sdk.replays`)."""
        lookup = getattr(self._store, "applied_before", None)
        if lookup is None or not records or not self._lookup_pays:
            return {}
        ids = [event_id for event_id, replayed in map(self._scan, records)
               if not replayed and not isinstance(event_id, InvalidEventId)]
        if not ids:
            return {}
        found: dict[Any, bytes | None] = lookup(consumer=self.consumer, event_ids=ids)
        # New messages: skip the lookup until a claim meets a duplicate again (its array of
        # ids costs a tenth of a new batch's client CPU); the first redelivered batch then
        # goes through the claim, the rest of a redelivery costs the lookup only.
        self._lookup_pays = bool(found)
        return found

    def _scan(self, record: KafkaRecord) -> tuple[uuid.UUID | InvalidEventId, bool]:
        found = self._scanned.get(id(record))
        return found if found is not None else scan_event_id(record, REPLAY_HEADER)

    def _prepare(self, record: KafkaRecord) -> InboxMessage | InvalidEventId:
        found = self._prepared.get(id(record))
        if found is None:
            event_id = self._scan(record)[0]
            found = event_id if isinstance(event_id, InvalidEventId) else to_message(record, event_id)
            self._prepared[id(record)] = found
        return found

    def _known_duplicate(self, record: KafkaRecord, event_id: uuid.UUID | InvalidEventId, replayed: bool) -> bool:
        """Found by the lookup with this body's hash (hashed only when found)."""
        if replayed or isinstance(event_id, InvalidEventId):
            return False
        digest = self._known.get(event_id, _ABSENT)
        return digest is not _ABSENT and digest == payload_sha256(record.value)

    # -- one transaction --------------------------------------------------------------

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

    def _one_trip(self, record: KafkaRecord, message: InboxMessage, result: BatchResult) -> bool:
        """The statements handler's transaction in one round trip; True when it committed
        (the record is counted and settled), False when nothing was written."""
        assert self._statements is not None
        try:
            statements = _checked(self._statements(message))
        except Exception:  # noqa: BLE001 - raised again by the usual way, under the policies
            return False
        self._sync()  # a COMMIT deferred before it, by a message that went the usual way
        committed = self._store.claim_and_apply(  # type: ignore[attr-defined]
            consumer=self.consumer, message=message, payload_sha256=payload_sha256(message.value),
            statements=statements)
        if committed is None:  # no pipeline mode here: the handler's way, deferred COMMITs and all
            self._statements = None
        if not committed:
            return False
        self._applied[record.topic] += 1
        result.applied += 1
        self._settle((record,), result)
        return True

    def _chain(self, records: Sequence[KafkaRecord], start: int, result: BatchResult) -> tuple[int, bool]:
        """The statements handler's transactions of ``records[start:]``, one a message, chained
        (``PgInboxStore.send_trip``): up to ``CHAIN_DEPTH`` of them sent ahead of their
        answers, the server applying one while the next is prepared.  Each commits only when
        the one before it did, so order holds as one at a time.  Stops before a record that
        cannot go so (an invalid event id, a duplicate found by the lookup, ``apply``
        raising, a statement that cannot be bound) and at the first transaction that did
        not commit.  Returns (records settled, whether the next one's transaction failed)."""
        assert self._statements is not None
        self._sync()  # a COMMIT deferred before it, by a message that went the usual way
        store, apply = self._store, self._statements
        sent: list[KafkaRecord] = []  # sent, answer not read yet (oldest first)
        settled, index, total, sending = 0, start, len(records), True
        try:
            while True:
                while sending and index < total and len(sent) - settled < CHAIN_DEPTH:
                    record = records[index]
                    event_id, replayed = self._scan(record)
                    if isinstance(event_id, InvalidEventId) or (
                            self._known and self._known_duplicate(record, event_id, replayed)):
                        sending = False
                        break
                    message = self._prepare(record)
                    assert isinstance(message, InboxMessage)
                    try:
                        statements = _checked(apply(message))
                    except Exception:  # noqa: BLE001 - raised again by the usual way, under the policies
                        sending = False
                        break
                    done = store.send_trip(  # type: ignore[attr-defined]
                        consumer=self.consumer, message=message, payload_sha256=payload_sha256(message.value),
                        statements=statements)
                    if not done:
                        if done is None:  # this store cannot chain: one trip a message from now on
                            self._chained = False
                            self._log.info("inbox_chaining_off", consumer=self.consumer,
                                           why="no pipeline mode, or a chain broke with nothing failing "
                                               "before it (a transaction pooler moving transactions)")
                        sending = False
                        break
                    sent.append(record)
                    index += 1
                if settled == len(sent):
                    return settled, False
                if not store.receive_trip():  # type: ignore[attr-defined]
                    return settled, True
                record = sent[settled]
                settled += 1
                self._applied[record.topic] += 1
                result.applied += 1
                self._settle((record,), result)
        finally:
            store.end_trips()  # type: ignore[attr-defined]

    def _after_commits(self, callback: Callable[[], None]) -> None:
        """``callback`` now, or after the deferred COMMIT before it was confirmed (order kept)."""
        if self._deferring:
            self._store.after_commit(callback)  # type: ignore[attr-defined]
        else:
            callback()

    def _count(self, applied: Counter[str], duplicates: Counter[str], result: BatchResult) -> None:
        if applied:
            self._applied.update(applied)
            result.applied += sum(applied.values())
        if duplicates:
            self._dropped.update(duplicates)
            result.duplicates += sum(duplicates.values())

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

    def _apply_batch(self, conn: Any, messages: Sequence[InboxMessage], claims: Sequence[Claim | None]) -> bool:
        """The batch handler on all new messages in one savepoint; False (rolled back) when
        something other than new or duplicate came, or when it failed."""
        assert self._batch_handler is not None
        batch_handler = self._batch_handler

        def apply(fresh: list[InboxMessage]) -> None:
            with self._store.attempt():
                batch_handler(conn, fresh)
                if self._store.in_failed_transaction():
                    raise HandlerTransactionFailed()

        return self._apply_fresh(messages, claims, apply, failed="batch_handler_failed")

    def _apply_statements(self, messages: Sequence[InboxMessage], claims: Sequence[Claim | None]) -> bool:
        """The statements of every new message in one pipeline (one round trip), in one
        savepoint; False (rolled back, or nothing sent) when something other than new or
        duplicate came, when the statements handler raised or answered wrongly, or when a
        statement failed: then the batch goes one message at a time, where each failure is
        judged."""
        assert self._batch_statements is not None
        statements_of = self._batch_statements

        def ready() -> bool:
            if self._store.can_pipeline():  # type: ignore[attr-defined]
                return True
            self._batch_statements = None  # no pipeline mode here: one by one from now on
            return False

        def apply(fresh: list[InboxMessage]) -> None:
            statements = [pair for message in fresh for pair in _checked(statements_of(message))]
            with self._store.attempt():
                self._store.execute_all(statements)  # type: ignore[attr-defined]

        return self._apply_fresh(messages, claims, apply, failed="statements_batch_failed", ready=ready)

    def _apply_fresh(self, messages: Sequence[InboxMessage], claims: Sequence[Claim | None],
                     apply: Callable[[list[InboxMessage]], None], *, failed: str,
                     ready: Callable[[], bool] = lambda: True) -> bool:
        """``apply`` to the batch's new messages at once (its own savepoint); True when it
        went through or nothing was new, False (one message at a time next) when something
        other than new or duplicate came, when ``ready`` says no, or when ``apply`` failed
        (logged as ``failed``).  A broken connection propagates: the batch is retried whole."""
        if any(claim not in ("new", "duplicate") for claim in claims):
            return False
        fresh = [m for m, claim in zip(messages, claims, strict=True) if claim == "new"]
        if not fresh:
            return True
        if not ready():
            return False
        try:
            apply(fresh)
        except Exception as exc:  # noqa: BLE001 - one by one next, where each failure is judged
            if isinstance(exc, DatabaseUnavailable):
                raise  # the connection broke: the batch is retried as a whole
            self._log.info(failed, messages=len(fresh), error=describe(exc),
                           hint="applying the batch one message at a time")
            return False
        return True

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
            lost_prepared = getattr(self._store, "lost_prepared", None)
            if lost_prepared is not None and lost_prepared(exc):
                # Not the handler's failure: the batch is retried whole, no attempt counted.
                raise DatabaseUnavailable(f"a transaction pooler lost a statement psycopg had prepared "
                                          f"({describe(exc)}); psycopg's automatic preparing is off "
                                          f"from now on") from exc
            raise _HandlerFailed(exc) from exc
        if self._store.in_failed_transaction():
            raise _HandlerFailed(HandlerTransactionFailed())

    # -- outcomes (consumer_sdk.rejections) -------------------------------------------

    def send_dead_letter(self, letter: DeadLetter, result: BatchResult) -> None:
        """Send ``letter``; on failure raise :class:`DeadLetterBlocked` (never retriable here:
        retrying the batch would run the handler again).  The caller settles the record."""
        self._rejections.send_dead_letter(letter, result)

    def _retry_alone(self, record: KafkaRecord, error: BaseException, result: BatchResult) -> None:
        """Retry one failed record in its own transactions until it settles or the policy gives up."""
        retry = self._policies.retry
        attempt = 1
        while True:
            if isinstance(error, PermanentError) or not retry.allows(attempt + 1):
                self._rejections.exhausted(record, error, attempt, result)
                return
            self._sleep(retry.delay_s(attempt))
            attempt += 1
            _settled, halt = self._transaction([record], result, attempt=attempt)
            if halt is None:
                return
            if halt.stop:
                raise self._rejections.stopped(record, halt)
            error = halt.error

    def _settle(self, records: Sequence[KafkaRecord], result: BatchResult) -> None:
        if records:
            result.settled += len(records)
            self._on_settled(records)



def _checked(statements: Any) -> list[tuple[Any, Any]]:
    """A statements handler's answer as a list of ``(query, params)`` pairs, or a TypeError
    that says what came back instead."""
    if isinstance(statements, (str, bytes)) or not isinstance(statements, Sequence):
        raise TypeError(f"a statements handler returns a list of (query, params) pairs, not {type(statements).__name__}")
    pairs = list(statements)
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"a statements handler returns (query, params) pairs, not {pair!r:.80}")
    return pairs


def _executing(statements: StatementsHandler) -> Handler:
    """A statements handler as a handler: each statement executed on the consumer's connection."""
    def handler(conn: Any, message: InboxMessage) -> None:
        for sql, params in _checked(statements(message)):
            conn.execute(sql, params)

    return handler


def _one_of(batch_handler: BatchHandler) -> Handler:
    def one(conn: Any, message: InboxMessage) -> None:
        batch_handler(conn, [message])

    return one
