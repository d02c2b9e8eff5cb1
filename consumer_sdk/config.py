"""The dedup consumer's settings: one frozen, keyword-only object, validated at construction.

Units are in the names.  librdkafka properties pass through ``kafka_properties``
(security, tuning), except those the guarantees depend on: offsets are committed
by the SDK only, after the database commit (:data:`REQUIRED_CONSUMER`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from consumer_sdk.errors import ConfigError
from consumer_sdk.model import Action, RetryPolicy
from consumer_sdk.secrets import safe_repr, validate_dsn

DEFAULT_BATCH_SIZE = 1
DEFAULT_PREFETCH_RECORDS = 500
DEFAULT_POLL_TIMEOUT_S = 1.0
DEFAULT_DEAD_LETTER_TOPIC = "{topic}.dlq"
DEFAULT_DEAD_LETTER_TIMEOUT_S = 30.0
#: librdkafka's largest ``message.max.bytes``: the dead-letter producer never refuses a
#: letter the source topic carried; the dead-letter topic's own limit decides.
DEFAULT_DEAD_LETTER_MAX_BYTES = 1_000_000_000
DEFAULT_INBOX_RETENTION_S = 14 * 24 * 3600.0  # twice Kafka's default topic retention
DEFAULT_CLEANUP_INTERVAL_S = 600.0
DEFAULT_CLEANUP_BATCH = 1000
DEFAULT_DB_BACKOFF_INITIAL_S = 0.2
DEFAULT_DB_BACKOFF_MAX_S = 10.0
#: Microseconds a wait for the database's answer polls its socket before sleeping (see
#: outbox_core.spin); the most it may be set to.
DEFAULT_DB_SPIN_US = 100.0
MAX_DB_SPIN_US = 10_000.0

#: Set by the SDK whatever ``kafka_properties`` say: no offset moves on its own.
REQUIRED_CONSUMER: dict[str, Any] = {"enable.auto.commit": False, "enable.auto.offset.store": False}
DEFAULT_CONSUMER: dict[str, Any] = {"auto.offset.reset": "earliest", "enable.partition.eof": False}

#: Properties the admin client and the dead-letter producer inherit (connection and security).
_SHARED_PREFIXES = ("bootstrap.", "security.", "sasl.", "ssl.", "client.", "socket.", "broker.",
                    "reconnect.", "api.", "metadata.", "enable.ssl", "debug", "log")
_ACTIONS = ("dead_letter", "skip", "stop")
_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


@dataclass(frozen=True, kw_only=True)
class InboxConfig:
    """Settings of one :class:`~consumer_sdk.inbox.InboxConsumer`.

    ``name`` is the inbox key (``outbox_inbox.consumer``) and, by default, the
    Kafka group id: every member of a group must share it.  ``assignment="assign"``
    reads every partition of ``topics`` without group membership (one instance
    only; offsets are still committed under the group id; partitions added later
    are not picked up).  ``batch_size > 1`` is the throughput mode: one transaction
    and one offset commit per batch, same guarantees.  With ``batch_size=1`` (one
    transaction per message), a poll takes up to ``prefetch_records`` messages, applies
    each in its own transaction and commits their offsets together after the last one
    (and before any back-off, revocation or close): the offset still follows the database
    commit, and a crash redelivers at most one poll's messages, which the inbox drops
    (``prefetch_records=1``: an offset commit per message).  ``dsn`` is a libpq
    connection string (or pass ``connect=`` to the consumer).  ``dead_letter_topic``
    may contain ``{topic}``, the source topic's name.  ``dead_letter_max_bytes`` is the
    dead-letter producer's ``message.max.bytes`` (by default the largest librdkafka
    allows, so a letter as large as its source record goes); ``check_dead_letter_topics``
    refuses to start when a dead-letter topic is missing.  ``inbox_retention_s`` None
    keeps inbox rows forever; otherwise it must exceed the topics' retention
    (checked at start when ``check_retention``).  In a batch, a per-message handler runs
    with no savepoint while nothing fails; when one fails, the transaction rolls back and
    the handlers of the messages before it run again (their first run's writes were rolled
    back), so keep a handler's effects outside the database idempotent, or set
    ``savepoint_per_message`` (one round trip more per message) to run each successful
    handler once.  ``db_spin_us``: how long a wait for the database's answer polls the
    socket before sleeping on it (0: sleep at once, as psycopg does); it saves the wake-up
    that is most of a short round trip on virtual machines, at up to that much CPU a wait,
    and pauses itself when answers keep coming later than that (:mod:`outbox_core.spin`).
    None (the default) is ``DEFAULT_DB_SPIN_US``, or 0 when this process may use less than
    one core (a container's CPU limit, read from its cgroup at start: there a poll's CPU
    counts against the quota, and throttling cost more than the wake-ups it saved).
    """

    name: str
    dsn: str = ""
    bootstrap_servers: str
    topics: Sequence[str]
    group_id: str | None = None
    kafka_properties: Mapping[str, Any] = field(default_factory=dict)
    assignment: Literal["subscribe", "assign"] = "subscribe"
    batch_size: int = DEFAULT_BATCH_SIZE
    prefetch_records: int = DEFAULT_PREFETCH_RECORDS
    poll_timeout_s: float = DEFAULT_POLL_TIMEOUT_S
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    on_invalid_event_id: Action = "dead_letter"
    on_payload_mismatch: Action = "dead_letter"
    dead_letter_topic: str = DEFAULT_DEAD_LETTER_TOPIC
    dead_letter_timeout_s: float = DEFAULT_DEAD_LETTER_TIMEOUT_S
    dead_letter_max_bytes: int = DEFAULT_DEAD_LETTER_MAX_BYTES
    check_dead_letter_topics: bool = True
    inbox_retention_s: float | None = DEFAULT_INBOX_RETENTION_S
    cleanup_interval_s: float = DEFAULT_CLEANUP_INTERVAL_S
    cleanup_batch: int = DEFAULT_CLEANUP_BATCH
    check_retention: bool = True
    #: replay ids (``outbox-relay replay``) whose events are applied once more (consumer_sdk/replays.py)
    apply_replays: Sequence[str] = ()
    savepoint_per_message: bool = False
    db_backoff_initial_s: float = DEFAULT_DB_BACKOFF_INITIAL_S
    db_backoff_max_s: float = DEFAULT_DB_BACKOFF_MAX_S
    db_spin_us: float | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"name must be 1-200 of [A-Za-z0-9._:-], got {self.name!r}")
        if self.dsn:
            validate_dsn(self.dsn, option="InboxConfig.dsn")
        if isinstance(self.topics, str) or not self.topics:
            raise ConfigError("topics must be a non-empty list of topic names")
        if not self.bootstrap_servers and "bootstrap.servers" not in self.kafka_properties:
            raise ConfigError("no Kafka cluster given: set bootstrap_servers")
        if self.assignment not in ("subscribe", "assign"):
            raise ConfigError("assignment must be 'subscribe' or 'assign'")
        for name in ("on_invalid_event_id", "on_payload_mismatch"):
            if getattr(self, name) not in _ACTIONS:
                raise ConfigError(f"{name} must be one of {', '.join(_ACTIONS)}")
        self._check_numbers()
        if "{topic}" not in self.dead_letter_topic and self.dead_letter_topic in self.topics:
            raise ConfigError("dead_letter_topic must differ from the consumed topics")
        strategy = str(self.kafka_properties.get("partition.assignment.strategy", ""))
        if "cooperative" in strategy:
            raise ConfigError("cooperative rebalancing is not supported: use range or roundrobin")

    def _check_numbers(self) -> None:
        if self.batch_size < 1 or self.prefetch_records < 1:
            raise ConfigError("batch_size and prefetch_records must be at least 1")
        if self.poll_timeout_s <= 0 or self.dead_letter_timeout_s <= 0 or self.cleanup_interval_s <= 0:
            raise ConfigError("poll_timeout_s, dead_letter_timeout_s and cleanup_interval_s must be positive")
        if self.inbox_retention_s is not None and self.inbox_retention_s <= 0:
            raise ConfigError("inbox_retention_s must be positive (or None: keep the inbox forever)")
        if not 1000 <= self.dead_letter_max_bytes <= DEFAULT_DEAD_LETTER_MAX_BYTES:
            raise ConfigError(f"dead_letter_max_bytes must be 1000..{DEFAULT_DEAD_LETTER_MAX_BYTES}")
        if self.cleanup_batch < 1:
            raise ConfigError("cleanup_batch must be at least 1")
        if not 0 < self.db_backoff_initial_s <= self.db_backoff_max_s:
            raise ConfigError("need 0 < db_backoff_initial_s <= db_backoff_max_s")
        if self.db_spin_us is not None and not 0 <= self.db_spin_us <= MAX_DB_SPIN_US:
            raise ConfigError(f"db_spin_us must be 0 (off) to {MAX_DB_SPIN_US:,.0f}, got {self.db_spin_us!r}")

    def __repr__(self) -> str:
        """No secret: the DSN's password and secret Kafka properties show as ``***``."""
        return safe_repr(self, {f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def poll_records(self) -> int:
        """Messages one poll takes: a batch, or ``prefetch_records`` one-at-a-time messages."""
        return self.batch_size if self.batch_size > 1 else self.prefetch_records

    @property
    def group(self) -> str:
        return self.group_id or self.name

    def shared_kafka(self) -> dict[str, Any]:
        """Connection and security properties, for the admin client and the dead-letter producer."""
        shared = {k: v for k, v in self.kafka_properties.items() if k.startswith(_SHARED_PREFIXES)}
        if self.bootstrap_servers:
            shared["bootstrap.servers"] = self.bootstrap_servers
        return shared

    def dead_letter_kafka(self) -> dict[str, Any]:
        """The dead-letter producer's configuration: connection, security and size limit."""
        return {**self.shared_kafka(), "message.max.bytes": self.dead_letter_max_bytes}

    def dead_letter_topics(self) -> list[str]:
        """The dead-letter topics of the consumed topics (the template filled in)."""
        return sorted({self.dead_letter_topic.replace("{topic}", t) for t in self.topics})

    def may_dead_letter(self) -> bool:
        """True when some policy sends messages to the dead-letter topic."""
        return "dead_letter" in (self.on_invalid_event_id, self.on_payload_mismatch, self.retry.then)

    def consumer_kafka(self) -> dict[str, Any]:
        """The consumer's librdkafka configuration."""
        config: dict[str, Any] = {**DEFAULT_CONSUMER, **self.kafka_properties, **self.shared_kafka()}
        config["group.id"] = self.group
        config.update(REQUIRED_CONSUMER)
        return config
