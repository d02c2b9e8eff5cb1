"""The statements handler's round trips, a part of :class:`~consumer_sdk.processor.Processor`:
one at a time, the claim, a message's statements and the COMMIT in one round trip, and those
transactions chained (sent ahead of their answers); and the handler adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from consumer_sdk.model import (
    BatchResult,
    InboxMessage,
    InvalidEventId,
    KafkaRecord,
    payload_sha256,
)
from consumer_sdk.processor_state import ProcessorState

if TYPE_CHECKING:
    from consumer_sdk.processor import BatchHandler, Handler, StatementsHandler

#: One at a time, how many of a statements handler's transactions are sent ahead of their
#: answers (see Processor._chain).  A failure sends those after it the usual way again.
CHAIN_DEPTH = 16


class ProcessorStatements(ProcessorState):
    """A statements handler's transactions in one round trip each, chained."""

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
        raising, a statement that cannot be bound), when the consumer must poll
        (``between_due``) and at the first transaction that did not commit.  Returns
        (records settled, whether the next one's transaction failed)."""
        assert self._statements is not None
        self._sync()  # a COMMIT deferred before it, by a message that went the usual way
        store, apply = self._store, self._statements
        sent: list[KafkaRecord] = []  # sent, answer not read yet (oldest first)
        settled, index, total, sending = 0, start, len(records), True
        try:
            while True:
                while sending and index < total and len(sent) - settled < CHAIN_DEPTH:
                    if sent and self._keep_alive_due():  # the consumer must poll: end the chain here
                        sending = False
                        break
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
