"""In-memory fakes for unit tests of services that use the SDK (no database, no broker).

:class:`FakeInbox` runs the real :class:`~consumer_sdk.processor.Processor` (the
same dedup, retry, dead-letter and stop rules as :class:`~consumer_sdk.inbox.InboxConsumer`)
over an in-memory inbox and dead-letter list, so a handler can be unit-tested
for "applied once, duplicates dropped, failures dead-lettered"::

    inbox = FakeInbox(handler, connection=my_fake_conn)
    record = make_record(topic="orders", value={"order": 1})
    inbox.deliver(record, record)
    assert inbox.applied == 1 and inbox.duplicates == 1

The handler gets ``connection`` as its first argument (anything: a stub, a real
connection, None).  Only the inbox rows are transactional here: the handler's own
writes on a stub are not rolled back when it raises.  The fake store passes the
same contract tests as :class:`~consumer_sdk.store.PgInboxStore`.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import structlog

from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import (
    EVENT_ID_HEADER,
    BatchResult,
    Claim,
    DeadLetter,
    InboxMessage,
    KafkaRecord,
    RetryPolicy,
)
from consumer_sdk.processor import BatchHandler, Handler, Processor
from consumer_sdk.rejections import Policies

InboxKey = tuple[str, uuid.UUID]


class FakeInboxStore:
    """The inbox as a dict, with transactions and savepoints as snapshots.

    ``handler_writes_roll_back``: say that the handler's writes on ``connection`` roll back
    with the transaction, as with :class:`~consumer_sdk.store.PgInboxStore`; the processor
    then sets no savepoint per message and, when a handler fails, runs the handlers of the
    records before it again.  Off by default: a stub connection keeps what a handler did."""

    def __init__(self, connection: Any = None, *, handler_writes_roll_back: bool = False) -> None:
        self.connection = connection
        self.handler_writes_roll_back = handler_writes_roll_back
        self.rows: dict[InboxKey, bytes | None] = {}
        self._snapshots: list[dict[InboxKey, bytes | None]] = []

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        if self._snapshots:
            raise RuntimeError("transactions do not nest; use attempt()")
        with self._savepoint():
            yield self.connection

    @contextmanager
    def attempt(self) -> Iterator[None]:
        if not self._snapshots:
            raise RuntimeError("attempt() runs inside transaction()")
        with self._savepoint():
            yield

    @contextmanager
    def _savepoint(self) -> Iterator[None]:
        self._snapshots.append(copy.copy(self.rows))
        try:
            yield
        except BaseException:
            self.rows = self._snapshots.pop()
            raise
        self._snapshots.pop()

    def claim(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None) -> Claim:
        if not self._snapshots:
            raise RuntimeError("claim() runs inside transaction()")
        return self._claim(consumer, message, payload_sha256)

    def _claim(self, consumer: str, message: InboxMessage, payload_sha256: bytes | None) -> Claim:
        key = (consumer, message.event_id)
        if key not in self.rows:
            self.rows[key] = payload_sha256
            return "new"
        return "duplicate" if self.rows[key] == payload_sha256 else "mismatch"

    def claim_many(self, *, consumer: str, messages: Sequence[InboxMessage],
                   digests: Sequence[bytes | None]) -> list[Claim]:
        if not self._snapshots:
            raise RuntimeError("claim_many() runs inside transaction()")
        return [self._claim(consumer, m, d) for m, d in zip(messages, digests, strict=True)]

    def unclaim(self, *, consumer: str, event_ids: Sequence[uuid.UUID]) -> None:
        if not self._snapshots:
            raise RuntimeError("unclaim() runs inside transaction()")
        for event_id in event_ids:
            self.rows.pop((consumer, event_id), None)

    def in_failed_transaction(self) -> bool:
        return False


class FakeDeadLetters:
    """Collects dead letters; set ``fail`` to an exception to make ``send`` raise it."""

    def __init__(self) -> None:
        self.letters: list[DeadLetter] = []
        self.fail: BaseException | None = None

    def send(self, letter: DeadLetter) -> None:
        if self.fail is not None:
            raise self.fail
        self.letters.append(letter)


def make_record(*, value: Any = None, topic: str = "test", partition: int = 0, offset: int = 0,
                key: str | bytes | None = None, event_id: uuid.UUID | str | None = None,
                headers: Mapping[str, str | bytes | None] | None = None,
                omit_event_id: bool = False) -> KafkaRecord:
    """A record as the relay would deliver it: ``event_id`` header (a new UUID by default;
    any string to test malformed ids; none with ``omit_event_id``), value as bytes
    (JSON-encoded unless it is bytes already)."""
    raw = value if isinstance(value, bytes) or value is None else json.dumps(value).encode()
    encoded: list[tuple[str, bytes | None]] = [
        (name, item.encode() if isinstance(item, str) else item) for name, item in (headers or {}).items()]
    if not omit_event_id:
        encoded.append((EVENT_ID_HEADER, str(event_id or uuid.uuid4()).encode()))
    return KafkaRecord(topic=topic, partition=partition, offset=offset,
                       key=key.encode() if isinstance(key, str) else key, value=raw, headers=tuple(encoded))


class FakeInbox:
    """The real processor over in-memory fakes; no sleeping (back-off delays are recorded)."""

    def __init__(self, handler: Handler | None = None, *, connection: Any = None, name: str = "test",
                 retry: RetryPolicy | None = None, policies: Policies | None = None,
                 metrics: ConsumerMetrics | None = None, batch_handler: BatchHandler | None = None,
                 handler_writes_roll_back: bool = False) -> None:
        self.store = FakeInboxStore(connection, handler_writes_roll_back=handler_writes_roll_back)
        self.dead_letters = FakeDeadLetters()
        self.metrics = metrics if metrics is not None else ConsumerMetrics()
        self.sleeps: list[float] = []
        self.settled: list[KafkaRecord] = []
        self.totals = BatchResult()
        chosen = policies or Policies(retry=retry or RetryPolicy())
        self.processor = Processor(
            consumer=name, store=self.store, handler=handler, dead_letters=self.dead_letters,
            policies=chosen, metrics=self.metrics, log=structlog.get_logger("consumer_sdk.testing"),
            sleep=self.sleeps.append, on_settled=self.settled.extend, batch_handler=batch_handler)

    def deliver(self, *records: KafkaRecord, batch: bool = True) -> BatchResult:
        """Process ``records`` as one batch (or one at a time with ``batch=False``)."""
        groups: Sequence[Sequence[KafkaRecord]] = [records] if batch else [[r] for r in records]
        result = BatchResult()
        for group in groups:
            result.add(self.processor.process(group))
        self.totals.add(result)
        return result

    @property
    def applied(self) -> int:
        return self.totals.applied

    @property
    def duplicates(self) -> int:
        return self.totals.duplicates


__all__ = ["FakeDeadLetters", "FakeInbox", "FakeInboxStore", "make_record"]
