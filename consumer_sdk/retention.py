"""Inbox retention versus the topics' retention: is every redelivery still deduplicated?

An inbox row is what turns a redelivered event into a dropped duplicate.  Kafka
can hand an event out again for as long as the topic keeps it (a group whose
offsets were reset or expired starts from the oldest message), so the inbox must
keep ids longer than each consumed topic keeps messages.  The consumer checks that
at start with the admin client and warns loudly (log ``inbox_retention_too_short``
at error level and the gauge ``outbox_consumer_inbox_retention_unsafe``) when a
redelivered message could outlive its inbox row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import ConfigResource
from confluent_kafka.admin._resource import ResourceType

from consumer_sdk.config import (
    MAX_INBOX_RETENTION_S,
    MAX_RECORDS,
    MIN_INBOX_RETENTION_S,
    check_int,
    check_seconds,
)
from consumer_sdk.errors import ConfigError
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.store import PgInboxStore
from consumer_sdk.store import cleanup_inbox as _cleanup_inbox


@dataclass(frozen=True, slots=True)
class RetentionFinding:
    """One topic's retention compared with the inbox's; ``topic_retention_s`` None means forever."""

    topic: str
    topic_retention_s: float | None
    inbox_retention_s: float | None

    @property
    def safe(self) -> bool:
        return retention_safe(self.topic_retention_s, self.inbox_retention_s)


def retention_safe(topic_retention_s: float | None, inbox_retention_s: float | None) -> bool:
    """True when the inbox keeps ids strictly longer than the topic keeps messages.

    ``inbox_retention_s`` None means the inbox is never cleaned (always safe);
    ``topic_retention_s`` None means the topic keeps messages forever.
    """
    if inbox_retention_s is None:
        return True
    if topic_retention_s is None:
        return False
    return inbox_retention_s > topic_retention_s


def topic_retention_s(retention_ms: str | int | None) -> float | None:
    """``retention.ms`` as seconds; -1 (or absent) means forever."""
    if retention_ms is None:
        return None
    value = int(retention_ms)
    return None if value < 0 else value / 1000.0


def describe_retention(admin: Any, topics: Sequence[str], *, timeout_s: float) -> dict[str, float | None]:
    """``{topic: retention seconds or None}`` from the brokers' topic configs."""
    resources = [ConfigResource(ResourceType.TOPIC, topic) for topic in topics]
    futures = admin.describe_configs(resources, request_timeout=timeout_s)
    found: dict[str, float | None] = {}
    for resource, future in futures.items():
        entries = future.result(timeout=timeout_s)
        entry = entries.get("retention.ms")
        found[resource.name] = topic_retention_s(entry.value if entry is not None else None)
    return found


def check_retention(kafka_config: dict[str, Any], topics: Sequence[str], inbox_retention_s: float | None,
                    *, timeout_s: float = 10.0) -> list[RetentionFinding]:
    """Compare each topic's retention with the inbox's (raises the client's errors)."""
    admin = AdminClient(kafka_config)
    retention = describe_retention(admin, topics, timeout_s=timeout_s)
    return [RetentionFinding(topic, retention.get(topic), inbox_retention_s) for topic in topics]


def report_retention(findings: Sequence[RetentionFinding], *, consumer: str, metrics: ConsumerMetrics,
                     log: Any) -> None:
    """Set the ``inbox_retention_unsafe`` gauge per topic; log an error for each unsafe one."""
    for finding in findings:
        metrics.inbox_retention_unsafe.labels(consumer, finding.topic).set(0 if finding.safe else 1)
        if not finding.safe:
            log.error("inbox_retention_too_short", topic=finding.topic,
                      topic_retention_s=finding.topic_retention_s, inbox_retention_s=finding.inbox_retention_s,
                      hint="a message redelivered after its inbox row was deleted would be applied again; "
                           "raise inbox_retention_s above the topic's retention.ms")


def check_cleanup(retention_s: object, batch: object, max_batches: object = 1) -> None:
    """Raise :class:`ConfigError` unless ``retention_s`` is finite seconds within the consumer's
    own bounds of ``inbox_retention_s`` (``MIN_INBOX_RETENTION_S``: an inbox row must outlive
    every redelivery of its event, which comes seconds to minutes later; 0 or a negative one
    deleted every row) and ``batch``/``max_batches`` are ints from 1 to ``MAX_RECORDS``."""
    check_seconds("retention_s (a shorter one deletes rows that redeliveries still need)", retention_s,
                  MAX_INBOX_RETENTION_S, low=MIN_INBOX_RETENTION_S, low_open=False)
    check_int("batch", batch, 1, MAX_RECORDS)
    check_int("max_batches", max_batches, 1, MAX_RECORDS)


def cleanup_inbox(store: PgInboxStore, *, consumer: str, retention_s: float, batch: int = 1000,
                  max_batches: int = 100) -> int:
    """:func:`consumer_sdk.store.cleanup_inbox` with its arguments checked first
    (:func:`check_cleanup`): a bad one raises :class:`ConfigError` and deletes nothing."""
    check_cleanup(retention_s, batch, max_batches)
    if not isinstance(consumer, str) or not consumer:
        raise ConfigError(f"consumer must be an inbox name, got {consumer!r}")
    return _cleanup_inbox(store, consumer=consumer, retention_s=retention_s, batch=batch, max_batches=max_batches)
