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
* The database failing under a handler's statements (the connection lost, the session
  ended, the database read-only) or aborting its transaction (a serialization failure, a
  deadlock: ``PgInboxStore.database_failure``) is not the handler's failure:
  :class:`~consumer_sdk.errors.DatabaseUnavailable` or
  :class:`~consumer_sdk.errors.TransactionConflict` propagates, the batch is retried whole
  with the database back-off, no attempt counted, never dead-lettered.
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
The processor is built from parts, a module each (see :mod:`consumer_sdk.processor_state`):
this one keeps the calls, their order and the retries; import it from here.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from consumer_sdk.errors import DeadLetterBlocked, PermanentError
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import (
    BatchResult,
    Claim,
    DeadLetter,
    InboxMessage,
    InvalidEventId,
    KafkaRecord,
    scan_event_id,
)
from consumer_sdk.processor_statements import CHAIN_DEPTH as CHAIN_DEPTH
from consumer_sdk.processor_statements import _executing, _one_of
from consumer_sdk.processor_transactions import ProcessorTransactions
from consumer_sdk.rejections import DeadLetterSink as DeadLetterSink
from consumer_sdk.rejections import Policies as Policies
from consumer_sdk.rejections import Rejections
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


class Processor(ProcessorTransactions):
    """Settles records for one logical consumer.  Not thread-safe: one caller at a time."""

    def __init__(self, *, consumer: str, store: InboxStore, handler: Handler | None,
                 dead_letters: DeadLetterSink, policies: Policies, metrics: ConsumerMetrics,
                 log: Any, sleep: Callable[[float], None],
                 on_settled: Callable[[Sequence[KafkaRecord]], None], batch_size: int | None = None,
                 batch_handler: BatchHandler | None = None, savepoint_per_message: bool = False,
                 statements: StatementsHandler | None = None, between: Callable[[], None] | None = None,
                 between_due: Callable[[], bool] = lambda: True) -> None:
        self.consumer = consumer
        # Called between two transactions of a process() call when between_due() says so
        # (none open, the COMMITs before confirmed): the consumer keeps its group membership
        # there; it may raise to abandon the rest of the call, whose records stay unsettled.
        # A chain of a statements handler's transactions ends early for it.
        self._between = between
        self._between_due = between_due
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
            if done and self._between is not None and self._between_due():
                self._sync()  # the records before it settled first
                self._between()
            if step == 1 and self._chained:
                settled, failed = self._chain(records, done, result)
                done += settled
                if failed:  # nothing of it written: the usual way says why
                    settled, halt = self._transaction([records[done]], result, attempt=1, settle=True)
                elif done < total and settled and self._keep_alive_due():
                    continue  # the chain ended for the keep-alive
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
