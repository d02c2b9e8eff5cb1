"""The state a :class:`~consumer_sdk.processor.Processor`'s parts share, and their small helpers.

The processor is one object built from parts by responsibility, each a module of its own:
the calls and their order, with retries (:mod:`consumer_sdk.processor`), one transaction
(:mod:`consumer_sdk.processor_transactions`), a batch's new messages at once
(:mod:`consumer_sdk.processor_batches`) and the statements handler's round trips
(:mod:`consumer_sdk.processor_statements`).  The attributes they share are declared here
once; ``Processor.__init__`` sets them.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from consumer_sdk.errors import HandlerTransactionFailed
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import (
    BatchResult,
    InboxMessage,
    InvalidEventId,
    KafkaRecord,
    payload_sha256,
    scan_event_id,
    to_message,
)
from consumer_sdk.rejections import Policies, Rejections, describe
from consumer_sdk.replays import REPLAY_HEADER

if TYPE_CHECKING:  # the processor's types, defined where users import them
    from consumer_sdk.processor import BatchHandler, Handler, InboxStore, StatementsHandler

_ABSENT = object()


class ProcessorState:
    """What every part of the processor reads or changes (see the module docstring)."""

    consumer: str
    _store: InboxStore
    _handler: Handler
    _batch_handler: BatchHandler | None
    _statements: StatementsHandler | None
    _chained: bool
    _batch_statements: StatementsHandler | None
    _rejections: Rejections
    _policies: Policies
    _metrics: ConsumerMetrics
    _log: Any
    _sleep: Callable[[float], None]
    _on_settled: Callable[[Sequence[KafkaRecord]], None]
    _known: dict[Any, bytes | None]
    _lookup_pays: bool
    _prepared: dict[int, InboxMessage | InvalidEventId]
    _scanned: dict[int, tuple[uuid.UUID | InvalidEventId, bool]]
    _deferring: bool
    _applied: Counter[str]
    _dropped: Counter[str]
    _optimistic: bool
    _between: Callable[[], None] | None
    _between_due: Callable[[], bool]

    def _keep_alive_due(self) -> bool:
        """True when ``between`` is to run before the next transaction (see Processor.__init__)."""
        return self._between is not None and self._between_due()

    def _database_failure(self, exc: BaseException) -> Exception | None:
        """The store's :class:`~consumer_sdk.errors.RetriableError` when ``exc``, raised by a
        handler, says the database failed under it (the connection lost, the session ended,
        the database read-only) or aborted its transaction (a serialization failure, a
        deadlock: ``PgInboxStore.database_failure``), not the handler: the batch is then
        retried whole with the database back-off, no attempt counted.  None: the handler's
        failure, for the retry policy."""
        judge = getattr(self._store, "database_failure", None)  # a store of another kind: never
        return None if judge is None else judge(exc)

    def _transaction_failed(self) -> Exception:
        """What a handler that returned with its transaction aborted stands for: it caught a
        database error and carried on.  When that error was the database's (a deadlock, a
        serialization failure, a read-only database: :meth:`_database_failure` of the error
        the store saw last, ``PgInboxStore.swallowed_error``), the store's
        :class:`~consumer_sdk.errors.RetriableError`, as when the handler does not catch it:
        the transaction is aborted either way, and the handler could not have helped it.  Else
        :class:`~consumer_sdk.errors.HandlerTransactionFailed` naming the error when it is
        known, for the retry policy (a handler that swallows its own failing statement)."""
        swallowed = getattr(self._store, "swallowed_error", lambda: None)()  # a store of another kind: unknown
        if swallowed is None:
            return HandlerTransactionFailed()
        failure = self._database_failure(swallowed)
        if failure is None:
            caught = describe(swallowed).splitlines()[0]  # its first line: Type: message
            failure = HandlerTransactionFailed(f"{HandlerTransactionFailed.__doc__} It caught {caught}")
        failure.__cause__ = swallowed
        return failure

    def _sync(self) -> None:
        if self._deferring:
            self._store.sync()  # type: ignore[attr-defined]

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

    def _settle(self, records: Sequence[KafkaRecord], result: BatchResult) -> None:
        if records:
            result.settled += len(records)
            self._on_settled(records)
