"""Plain data of the SDK (no I/O): records, messages, policies, results.

A :class:`KafkaRecord` is what the broker gave us, untrusted; an
:class:`InboxMessage` is what a handler sees: a record whose ``event_id`` header
parsed as a UUID.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from consumer_sdk.errors import ConfigError
from outbox_core.backoff import ceiling_s
from outbox_core.text import valid_topic_name as valid_topic_name

#: What happens to a message a policy rejects: sent to the dead-letter topic and
#: acknowledged, acknowledged with a log line only, or the consumer stops before it.
Action = Literal["dead_letter", "skip", "stop"]

#: The fate of an inbox insert: the event is new (apply it), was applied before
#: with the same body (drop it), or was applied before with another body (report it).
Claim = Literal["new", "duplicate", "mismatch"]

EVENT_ID_HEADER = "event_id"


Headers = tuple[tuple[str, bytes | None], ...]


@dataclass(frozen=True, slots=True)
class KafkaRecord:
    """One consumed Kafka message, detached from the client.  Headers keep their order."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers = ()

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name`` (None when absent or null)."""
        found: bytes | None = None
        for header_name, value in self.headers:
            if header_name == name:
                found = value
        return found


@dataclass(frozen=True, slots=True)
class InboxMessage:
    """What a handler receives: a record with a valid ``event_id``.

    ``headers`` maps each header name to its last value.  ``value`` is the raw
    body (JSON text for rows the relay wrote from the ``payload`` column, the bytes
    of ``payload_bytes`` otherwise, None for a tombstone).
    """

    event_id: uuid.UUID
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Mapping[str, bytes | None]

    def json(self) -> Any:
        """The value decoded as JSON (None for a tombstone); ``ValueError`` if it is not JSON."""
        return None if self.value is None else json.loads(self.value)

    def header(self, name: str) -> str | None:
        """Header ``name`` decoded as UTF-8 (None when absent or null)."""
        value = self.headers.get(name)
        return None if value is None else value.decode("utf-8", errors="replace")

    @property
    def key_text(self) -> str | None:
        """The key decoded as UTF-8 (the outbox stores keys as text)."""
        return None if self.key is None else self.key.decode("utf-8", errors="replace")


class InvalidEventId(ValueError):
    """The record has no usable ``event_id`` header; ``str()`` says why."""


def parse_event_id(record: KafkaRecord) -> uuid.UUID:
    """The record's ``event_id`` as a UUID; :class:`InvalidEventId` when missing or malformed."""
    return _parse_event_id(record.header(EVENT_ID_HEADER))


def _parse_event_id(raw: bytes | None) -> uuid.UUID:
    if raw is None:
        raise InvalidEventId("the message has no event_id header")
    try:
        return uuid.UUID(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise InvalidEventId(f"the event_id header is not a UUID: {raw[:64]!r}") from None


def scan_event_id(record: KafkaRecord, replay_header: str) -> tuple[uuid.UUID | InvalidEventId, bool]:
    """One pass over the headers: the event id (or why it is invalid, as :func:`parse_event_id`
    says) and whether header ``replay_header`` has a value (the last of each counts, as in
    :attr:`InboxMessage.headers`).  What the duplicate check needs, without a message."""
    raw: bytes | None = None
    replayed = False
    for name, value in record.headers:
        if name == EVENT_ID_HEADER:
            raw = value
        elif name == replay_header:
            replayed = value is not None
    try:
        return _parse_event_id(raw), replayed
    except InvalidEventId as exc:
        return exc, replayed


def to_message(record: KafkaRecord, event_id: uuid.UUID | None = None) -> InboxMessage:
    """Validate a record into an :class:`InboxMessage` (:class:`InvalidEventId` otherwise);
    ``event_id``: the record's, parsed already."""
    return InboxMessage(
        event_id=parse_event_id(record) if event_id is None else event_id,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        value=record.value,
        headers=dict(record.headers),
    )


def payload_sha256(value: bytes | None) -> bytes | None:
    """The digest the inbox keeps: SHA-256 of the value, None for a tombstone."""
    return None if value is None else hashlib.sha256(value).digest()


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How handler failures are retried.

    Attempt 1 is the first delivery; after a failure the next attempt waits
    ``backoff_initial_s * backoff_multiplier ** (attempt - 1)``, capped at
    ``backoff_max_s``.  ``max_attempts=None`` retries forever.  When attempts run
    out, or the handler raised :class:`~consumer_sdk.errors.PermanentError`,
    ``then`` decides: ``dead_letter`` (the offset moves on) or ``stop`` (the
    consumer stops before the message).
    """

    max_attempts: int | None = 5
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    backoff_multiplier: float = 2.0
    then: Literal["dead_letter", "stop"] = "dead_letter"

    def __post_init__(self) -> None:
        """ConfigError (a ValueError) for a policy the consumer cannot follow: NaN took the
        back-off away (95,724 attempts in 40 s) and max_attempts=nan dead-lettered at once."""
        attempts = self.max_attempts
        if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1):
            raise ConfigError(f"max_attempts must be a whole number of at least 1 (or None: retry "
                              f"forever), got {attempts!r}")
        for name in ("backoff_initial_s", "backoff_max_s", "backoff_multiplier"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError("need 0 <= backoff_initial_s <= backoff_max_s")
        if self.backoff_multiplier < 1:
            raise ConfigError("backoff_multiplier must be at least 1")
        if self.then not in ("dead_letter", "stop"):
            raise ConfigError("then must be 'dead_letter' or 'stop'")

    def allows(self, attempt: int) -> bool:
        """Whether attempt number ``attempt`` (1-based) may run."""
        return self.max_attempts is None or attempt <= self.max_attempts

    def delay_s(self, failed_attempt: int) -> float:
        """Seconds to wait after attempt ``failed_attempt`` failed."""
        return ceiling_s(failed_attempt, initial_s=self.backoff_initial_s, max_s=self.backoff_max_s,
                         multiplier=self.backoff_multiplier)


@dataclass(frozen=True, kw_only=True)
class DeadLetter:
    """A message on its way to the dead-letter topic, with why it went there."""

    record: KafkaRecord
    consumer: str
    reason: str  # invalid_event_id | payload_mismatch | retries_exhausted | permanent_error
    error: str
    error_type: str
    attempts: int


@dataclass(slots=True)
class BatchResult:
    """What one call to the processor did; tests and logs read it.

    Counts are of messages; ``settled`` is how many messages' offsets may be
    committed (applied, dropped as duplicates, dead-lettered or skipped).
    """

    applied: int = 0
    duplicates: int = 0
    mismatches: int = 0
    invalid: int = 0
    dead_lettered: int = 0
    skipped: int = 0
    handler_errors: int = 0
    settled: int = 0
    dead_letters: list[DeadLetter] = field(default_factory=list)

    def add(self, other: BatchResult) -> None:
        self.applied += other.applied
        self.duplicates += other.duplicates
        self.mismatches += other.mismatches
        self.invalid += other.invalid
        self.dead_lettered += other.dead_lettered
        self.skipped += other.skipped
        self.handler_errors += other.handler_errors
        self.settled += other.settled
        self.dead_letters.extend(other.dead_letters)
