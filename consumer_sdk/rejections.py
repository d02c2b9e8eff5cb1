"""What happens to a record the consumer does not apply: the policies, their outcomes.

A handler failure is counted and logged here; a record whose retries are exhausted, whose
event id is invalid or whose body differs from the one applied before under its event id
is dead-lettered, skipped or stops the consumer, as :class:`Policies` say.  A dead letter
is sent before its record is settled (:meth:`Rejections.send_dead_letter`); when it cannot
be sent, :class:`~consumer_sdk.errors.DeadLetterBlocked` pauses the record's partition
instead of running the handler again.  The :class:`~consumer_sdk.processor.Processor`
decides when; this module only how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from consumer_sdk.errors import ConsumerStopped, DeadLetterBlocked, DeadLetterFailed, PermanentError
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import (
    Action,
    BatchResult,
    DeadLetter,
    InboxMessage,
    InvalidEventId,
    KafkaRecord,
    RetryPolicy,
)

_MAX_ERROR_CHARS = 2000


class DeadLetterSink(Protocol):
    """Where rejected messages go.  ``send`` returns once the letter is durable."""

    def send(self, letter: DeadLetter) -> None:
        """Deliver ``letter`` or raise :class:`~consumer_sdk.errors.DeadLetterFailed`."""


@dataclass(frozen=True, kw_only=True)
class Policies:
    """The service's choices for handler failures and malformed or suspicious messages."""

    retry: RetryPolicy = RetryPolicy()
    on_invalid_event_id: Action = "dead_letter"
    on_payload_mismatch: Action = "dead_letter"


@dataclass(frozen=True, slots=True)
class Halt:
    """Why a transaction stopped before a record: a handler failure, or a ``stop`` policy."""

    error: BaseException
    reason: str
    stop: bool
    blocked: bool = False


def describe(error: BaseException) -> str:
    """``Type: message``, bounded, for logs and dead-letter headers: always UTF-8 text.

    A handler's error is the handler's text: a message built from undecodable bytes
    (``value.decode("utf-8", "surrogateescape")``) holds lone surrogates, which the dead
    letter's header could not encode, and an exception whose ``__str__`` raises could not
    be formatted; either crashed the consumer at the same record after every restart (an
    audit with hostile records).  Surrogates are written as ``\\udcXX`` escapes."""
    text = f"{type(error).__name__}: {message_of(error)}".encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def message_of(error: BaseException) -> str:
    """``str(error)``, or what says it could not be had: a handler's exception whose
    ``__str__`` raises is the handler's, and must not crash the consumer."""
    try:
        return str(error)
    except Exception as exc:  # noqa: BLE001 - the handler's exception, not this code's
        return f"<its message could not be formatted: {type(exc).__name__}>"


class Rejections:
    """The outcomes of the records a consumer does not apply, with their metrics and logs.

    ``judged``: the records (``id()``) dead-lettered or skipped during the current
    ``process()`` call; a transaction rolled back after judging one applies the records
    before a failure again, and must not send or count it twice."""

    def __init__(self, *, consumer: str, dead_letters: DeadLetterSink, policies: Policies,
                 metrics: ConsumerMetrics, log: Any) -> None:
        self.consumer = consumer
        self._dead_letters = dead_letters
        self._policies = policies
        self._metrics = metrics
        self._log = log
        self.judged: set[int] = set()

    def invalid(self, record: KafkaRecord, error: InvalidEventId, result: BatchResult) -> Halt | None:
        self._metrics.invalid.labels(self.consumer, record.topic).inc()
        result.invalid += 1
        self._log.warning("invalid_event_id", error=str(error), **where(record))
        return self.reject(record, "invalid_event_id", error, self._policies.on_invalid_event_id, result)

    def mismatch(self, record: KafkaRecord, message: InboxMessage, result: BatchResult) -> Halt | None:
        self._metrics.payload_mismatches.labels(self.consumer, record.topic).inc()
        result.mismatches += 1
        self._log.error("payload_mismatch", event_id=str(message.event_id),
                        hint="a producer reused an event_id for a different body", **where(record))
        error = PermanentError(f"event_id {message.event_id} was applied before with a different payload")
        return self.reject(record, "payload_mismatch", error, self._policies.on_payload_mismatch, result)

    def reject(self, record: KafkaRecord, reason: str, error: BaseException, action: Action,
               result: BatchResult) -> Halt | None:
        if action == "stop":
            return Halt(error, reason, stop=True)
        if action == "dead_letter":
            try:
                self.dead_letter(record, reason, error, 0, result)
            except DeadLetterBlocked as blocked:  # commit the records before it first
                return Halt(blocked, reason, stop=False, blocked=True)
        else:
            self._metrics.skipped.labels(self.consumer, record.topic, reason).inc()
            result.skipped += 1
            self._log.warning("message_skipped", reason=reason, **where(record))
        self.judged.add(id(record))
        return None

    def handler_failed(self, record: KafkaRecord, error: BaseException, attempt: int,
                       result: BatchResult) -> None:
        self._metrics.handler_errors.labels(self.consumer, record.topic).inc()
        result.handler_errors += 1
        self._log.warning("handler_failed", attempt=attempt, error=describe(error),
                          permanent=isinstance(error, PermanentError), **where(record))

    def exhausted(self, record: KafkaRecord, error: BaseException, attempts: int,
                  result: BatchResult) -> None:
        """No attempt left (or a permanent error): dead-letter, or raise :class:`ConsumerStopped`."""
        reason = "permanent_error" if isinstance(error, PermanentError) else "retries_exhausted"
        if self._policies.retry.then == "stop":
            raise self.stopped(record, Halt(error, reason, stop=True))
        self.dead_letter(record, reason, error, attempts, result)

    def dead_letter(self, record: KafkaRecord, reason: str, error: BaseException, attempts: int,
                    result: BatchResult) -> None:
        letter = DeadLetter(record=record, consumer=self.consumer, reason=reason,
                            error=describe(error), error_type=type(error).__name__, attempts=attempts)
        self.send_dead_letter(letter, result)

    def send_dead_letter(self, letter: DeadLetter, result: BatchResult) -> None:
        """Send ``letter``; on failure raise :class:`DeadLetterBlocked` (never retriable here:
        retrying the batch would run the handler again).  The caller settles the record."""
        record = letter.record
        try:
            self._dead_letters.send(letter)
        except DeadLetterFailed as exc:
            self._metrics.dead_letter_failures.labels(self.consumer, record.topic).inc()
            self._log.error("dead_letter_failed", reason=letter.reason, error=str(exc),
                            hint="the partition is paused until the letter is sent; see the "
                                 "OutboxConsumerDeadLetterFailures runbook", **where(record))
            raise DeadLetterBlocked(
                f"the dead letter of {record.topic}[{record.partition}]@{record.offset} could not be "
                f"produced ({exc}); the partition is paused and the letter retried, the handler is "
                "not run again", letter=letter, topic=record.topic, partition=record.partition,
                offset=record.offset) from exc
        self._metrics.dead_lettered.labels(self.consumer, record.topic, letter.reason).inc()
        result.dead_lettered += 1
        result.dead_letters.append(letter)
        self._log.error("message_dead_lettered", reason=letter.reason, attempts=letter.attempts,
                        error=letter.error, **where(record))

    def stopped(self, record: KafkaRecord, halt: Halt) -> ConsumerStopped:
        self._log.error("consumer_stopping", reason=halt.reason, error=describe(halt.error), **where(record))
        return ConsumerStopped(
            f"{halt.reason}: {describe(halt.error)} "
            f"(topic {record.topic}, partition {record.partition}, offset {record.offset})",
            reason=halt.reason, topic=record.topic, partition=record.partition, offset=record.offset)


def where(record: KafkaRecord) -> dict[str, Any]:
    return {"topic": record.topic, "partition": record.partition, "offset": record.offset}
