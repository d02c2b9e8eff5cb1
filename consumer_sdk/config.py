"""The dedup consumer's settings: one frozen, keyword-only object, validated at construction.

Units are in the names.  librdkafka properties pass through ``kafka_properties``
(security, tuning), except those the guarantees depend on: offsets are committed
by the SDK only, after the database commit (:data:`REQUIRED_CONSUMER`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from consumer_sdk.errors import ConfigError
from consumer_sdk.kafka_properties import check_consumer_properties
from consumer_sdk.model import Action, RetryPolicy, valid_topic_name
from consumer_sdk.secrets import safe_repr, validate_dsn
from outbox_core.text import bootstrap_servers_problem, lacks_token_source

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
#: librdkafka's default ``max.poll.interval.ms``.
DEFAULT_MAX_POLL_INTERVAL_MS = 300_000
#: ``keep_membership_max_intervals``: how many ``max.poll.interval.ms`` a member keeps its
#: partitions beside one transaction (a slow one is kept, a hung one not for ever); the most.
DEFAULT_KEEP_MEMBERSHIP_MAX_INTERVALS = 3
MAX_KEEP_MEMBERSHIP_INTERVALS = 1000

#: Properties the admin client and the dead-letter producer inherit (connection and security).
_SHARED_PREFIXES = ("bootstrap.", "security.", "sasl.", "ssl.", "client.", "socket.", "broker.",
                    "reconnect.", "api.", "metadata.", "enable.ssl", "debug", "log")
_ACTIONS = ("dead_letter", "skip", "stop")
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,200}")  # always fullmatch: "$" would let "name\n" through
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_GROUP_ID_CHARS = 255

#: Upper bounds of the duration options (seconds).  Beyond them librdkafka's and PostgreSQL's
#: own limits break in ways found only later (``consume(timeout=)`` past ~2.1e6 s returns at once,
#: an interval past ~9.2e12 s is 'interval out of range'), and no sane setting comes near them.
MAX_WAIT_S = 24 * 3600.0  #: a day: poll_timeout_s, dead_letter_timeout_s, back-offs
MAX_CLEANUP_INTERVAL_S = 365 * 24 * 3600.0  #: a year
MAX_INBOX_RETENTION_S = 100 * 365.25 * 24 * 3600.0  #: 100 years (None keeps rows for ever)
#: The shortest inbox retention: an inbox row must outlive every redelivery of its event
#: (a rebalance, a crash between the database and the offset commits, a prefetched poll), and
#: these take seconds to minutes; 0 or a negative value would delete every row at once.
MIN_INBOX_RETENTION_S = 60.0
#: The most records one option may ask for (confluent-kafka's ``consume()`` limit).
MAX_RECORDS = 1_000_000
MAX_RETRY_MULTIPLIER = 1000.0


def shown(value: object) -> str:
    """A value in an error message, its repr cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_int(option: str, value: Any, low: int, high: int, *,
              error: type[Exception] = ConfigError) -> int:
    """``value`` if it is an int (not a bool) in ``low..high``, else ``error`` (the SDK's
    configurations raise ConfigError, the jobs' InvalidJob)."""
    if type(value) is bool or not isinstance(value, int) or not low <= value <= high:
        raise error(f"{option} must be an integer from {low:,} to {high:,}, got {shown(value)}")
    return value


def check_seconds(option: str, value: Any, high: float, *, low: float = 0.0, low_open: bool = True,
                  unit: str = "seconds", error: type[Exception] = ConfigError) -> float:
    """``value`` as a float if it is a finite real number (not a bool) in ``(low, high]``
    (``[low, high]`` when not ``low_open``), else ``error``."""
    ok = (type(value) is not bool and isinstance(value, int | float) and math.isfinite(value)
          and (low < value if low_open else low <= value) and value <= high)
    if not ok:
        bound = f"more than {low:g}" if low_open else f"from {low:g}"
        raise error(f"{option} must be a finite number of {unit} {bound} to {high:g}, got {shown(value)}")
    return float(value)


def check_db_spin_us(value: Any, *, error: type[Exception] = ConfigError) -> None:
    """``db_spin_us`` of the consumer and of the jobs' pool: 0 (off) to ``MAX_DB_SPIN_US``."""
    if type(value) is bool or not isinstance(value, int | float) or not 0 <= value <= MAX_DB_SPIN_US:
        raise error(f"db_spin_us must be 0 (off) to {MAX_DB_SPIN_US:,.0f}, got {value!r}")


def check_bool(option: str, value: object) -> None:
    if type(value) is not bool:
        raise ConfigError(f"{option} must be True or False, got {value!r}")


def check_topic(option: str, topic: object) -> None:
    """Kafka's topic name rule; a leading '^' (a librdkafka regex subscription) is refused."""
    if isinstance(topic, str) and topic.startswith("^"):
        raise ConfigError(f"{option}: regex subscriptions are not supported, got {topic!r}")
    if not valid_topic_name(topic):
        raise ConfigError(f"{option} must be a Kafka topic name (1-249 of [A-Za-z0-9._-], not '.' "
                          f"or '..'), got {topic!r}")


def check_retry(retry: object) -> None:
    """The retry policy as the consumer needs it: a RetryPolicy (which refuses NaN and inf
    itself) whose waits are at most ``MAX_WAIT_S`` and multiplier at most ``MAX_RETRY_MULTIPLIER``."""
    if not isinstance(retry, RetryPolicy):
        raise ConfigError(f"retry must be a consumer_sdk.RetryPolicy, got {type(retry).__name__}")
    if retry.max_attempts is not None:
        check_int("retry.max_attempts (or None: retry forever)", retry.max_attempts, 1, 2**31 - 1)
    check_seconds("retry.backoff_initial_s", retry.backoff_initial_s, MAX_WAIT_S)
    check_seconds("retry.backoff_max_s", retry.backoff_max_s, MAX_WAIT_S)
    if retry.backoff_initial_s > retry.backoff_max_s:
        raise ConfigError(f"need retry.backoff_initial_s <= retry.backoff_max_s, got "
                          f"{retry.backoff_initial_s!r} > {retry.backoff_max_s!r}")
    m = retry.backoff_multiplier
    if type(m) is bool or not isinstance(m, int | float) or not 1 <= m <= MAX_RETRY_MULTIPLIER:
        raise ConfigError(f"retry.backoff_multiplier must be a number from 1 to {MAX_RETRY_MULTIPLIER:g}, got {m!r}")
    if retry.then not in ("dead_letter", "stop"):
        raise ConfigError(f"retry.then must be 'dead_letter' or 'stop', got {retry.then!r}")


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
    ``keep_membership_max_intervals``: a transaction running past half of
    ``max.poll.interval.ms`` has the consumer polled beside it (its partitions paused), so
    that the member keeps its partitions; after this many ``max.poll.interval.ms`` intervals
    (an int from 1 to ``MAX_KEEP_MEMBERSHIP_INTERVALS``) the polling stops
    (``membership_released``) and the member leaves its group one interval later, its
    partitions going to other members: none of them progresses while a handler hangs, so a
    larger value keeps them stalled longer; a handler slow on purpose wants a larger
    ``max.poll.interval.ms`` rather than this.

    Every value is checked here and a bad one raises :class:`~consumer_sdk.errors.ConfigError`
    naming the option, its allowed range and the value (a DSN by its type only).  Counts are
    ints (not bools) of 1 to ``MAX_RECORDS``; durations are finite seconds > 0, at most
    ``MAX_WAIT_S`` (a day) for waits and back-offs, ``MAX_CLEANUP_INTERVAL_S`` (a year) for
    ``cleanup_interval_s``, and ``MIN_INBOX_RETENTION_S`` (60 s) to ``MAX_INBOX_RETENTION_S``
    (100 years) for ``inbox_retention_s``.  ``topics`` is a list or tuple of Kafka topic names
    (no regex subscription); ``dead_letter_topic``, filled in, must be a topic name that is not
    consumed.  ``kafka_properties`` may not set ``group.id`` (use ``group_id``), nor
    ``bootstrap.servers`` when ``bootstrap_servers`` is set, nor ``enable.auto.commit`` or
    ``enable.auto.offset.store`` to anything but false (the SDK commits offsets itself); librdkafka
    checks the consumer's properties here too (a client made and destroyed at once, which contacts
    nothing: :mod:`consumer_sdk.kafka_properties`), so an unknown property or a value it refuses
    raises "invalid Kafka consumer configuration: ..." naming it, not ``start()``.
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
    keep_membership_max_intervals: int = DEFAULT_KEEP_MEMBERSHIP_MAX_INTERVALS

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(f"name must be 1-200 of [A-Za-z0-9._:-], got {self.name!r}")
        if self.group_id is not None:
            g = self.group_id
            if not isinstance(g, str) or not 1 <= len(g) <= MAX_GROUP_ID_CHARS or _CONTROL.search(g) \
                    or g != g.strip():
                raise ConfigError(f"group_id must be None (the name) or 1-{MAX_GROUP_ID_CHARS} characters "
                                  f"without control characters or surrounding spaces, got {g!r}")
        if not isinstance(self.dsn, str):  # the value itself may hold a password: only its type is named
            raise ConfigError(f"dsn must be a libpq connection string, got {type(self.dsn).__name__}")
        if self.dsn and not self.dsn.strip():
            raise ConfigError("dsn must not be blank (leave it '' only when passing connect= to the consumer)")
        if self.dsn:
            validate_dsn(self.dsn, option="InboxConfig.dsn")
        self._check_kafka()
        if self.assignment not in ("subscribe", "assign"):
            raise ConfigError(f"assignment must be 'subscribe' or 'assign', got {self.assignment!r}")
        for name in ("on_invalid_event_id", "on_payload_mismatch"):
            if getattr(self, name) not in _ACTIONS:
                raise ConfigError(f"{name} must be one of {', '.join(_ACTIONS)}, got {getattr(self, name)!r}")
        check_retry(self.retry)
        for name in ("check_dead_letter_topics", "check_retention", "savepoint_per_message"):
            check_bool(name, getattr(self, name))
        replays = self.apply_replays
        if not isinstance(replays, list | tuple | set | frozenset) \
                or not all(isinstance(r, str) and r for r in replays):
            raise ConfigError(f"apply_replays must be a list of replay ids (non-empty strings), got {replays!r}")
        self._check_numbers()
        self._check_dead_letter_topic()
        # librdkafka's own check, here rather than at start(): a misspelled property raised
        # at run time, perhaps on another thread.  It contacts nothing (kafka_properties.py).
        check_consumer_properties(self.consumer_kafka())

    def _check_kafka(self) -> None:
        topics = self.topics
        if not isinstance(topics, list | tuple) or not topics:
            raise ConfigError(f"topics must be a non-empty list of topic names, got {topics!r}")
        for topic in topics:
            check_topic("topics", topic)
        if not isinstance(self.bootstrap_servers, str):
            raise ConfigError(f"bootstrap_servers must be a string, got {type(self.bootstrap_servers).__name__}")
        props = self.kafka_properties
        if not isinstance(props, Mapping) or not all(isinstance(k, str) for k in props):
            raise ConfigError(f"kafka_properties must be a mapping of librdkafka property names, "
                              f"got {type(props).__name__}")
        if "group.id" in props:
            raise ConfigError("kafka_properties must not set group.id: use InboxConfig.group_id "
                              "(default: name)")
        for name, wanted in REQUIRED_CONSUMER.items():
            # Set by the SDK whatever was given; given otherwise, it was dropped in silence,
            # and a service that asked for auto-commit believed it had it.
            if name in props and str(props[name]).strip().lower() not in ("false", "0"):
                raise ConfigError(f"kafka_properties must not set {name}={props[name]!r}: the SDK "
                                  "stores and commits offsets itself, after the database commit of "
                                  f"the messages' handling (it sets {name}={str(wanted).lower()})")
        if "bootstrap.servers" in props and self.bootstrap_servers:
            raise ConfigError("kafka_properties must not set bootstrap.servers as well as bootstrap_servers: "
                              "use InboxConfig.bootstrap_servers")
        if not self.bootstrap_servers.strip() and not str(props.get("bootstrap.servers", "")).strip():
            raise ConfigError("no Kafka cluster given: set bootstrap_servers")
        # librdkafka reports a malformed list only while connecting, as a cluster that is down.
        problem = bootstrap_servers_problem(self.bootstrap_servers or props.get("bootstrap.servers"))
        if problem is not None:
            raise ConfigError(f"bootstrap_servers {problem}")
        if lacks_token_source(props):
            raise ConfigError("kafka_properties: sasl.mechanism=OAUTHBEARER needs a token source: "
                              "sasl.oauthbearer.method=oidc (with its client id, secret and token "
                              "endpoint), an oauth_cb, or enable.sasl.oauthbearer.unsecure.jwt=true "
                              "for a test cluster")

    def _check_dead_letter_topic(self) -> None:
        template = self.dead_letter_topic
        if not isinstance(template, str):
            raise ConfigError(f"dead_letter_topic must be a string, got {template!r}")
        for topic in self.topics:
            filled = template.replace("{topic}", topic)
            if self.may_dead_letter():  # a letter is produced there: it must be a topic name
                check_topic(f"dead_letter_topic (filled in for {topic!r})", filled)
            if filled in self.topics:
                raise ConfigError(f"dead_letter_topic must differ from the consumed topics: {template!r} "
                                  f"gives {filled!r}, which is consumed (dead letters would come back for ever)")

    def _check_numbers(self) -> None:
        check_int("batch_size", self.batch_size, 1, MAX_RECORDS)
        check_int("prefetch_records", self.prefetch_records, 1, MAX_RECORDS)
        check_int("cleanup_batch", self.cleanup_batch, 1, MAX_RECORDS)
        check_int("dead_letter_max_bytes", self.dead_letter_max_bytes, 1000, DEFAULT_DEAD_LETTER_MAX_BYTES)
        check_int("keep_membership_max_intervals (of max.poll.interval.ms)", self.keep_membership_max_intervals,
                  1, MAX_KEEP_MEMBERSHIP_INTERVALS)
        check_seconds("poll_timeout_s", self.poll_timeout_s, MAX_WAIT_S)
        check_seconds("dead_letter_timeout_s", self.dead_letter_timeout_s, MAX_WAIT_S)
        check_seconds("cleanup_interval_s", self.cleanup_interval_s, MAX_CLEANUP_INTERVAL_S)
        if self.inbox_retention_s is not None:
            check_seconds("inbox_retention_s (or None: keep the inbox for ever)", self.inbox_retention_s,
                          MAX_INBOX_RETENTION_S, low=MIN_INBOX_RETENTION_S, low_open=False)
        check_seconds("db_backoff_initial_s", self.db_backoff_initial_s, MAX_WAIT_S)
        check_seconds("db_backoff_max_s", self.db_backoff_max_s, MAX_WAIT_S)
        if self.db_backoff_initial_s > self.db_backoff_max_s:
            raise ConfigError(f"need db_backoff_initial_s <= db_backoff_max_s, got {self.db_backoff_initial_s!r} "
                              f"> {self.db_backoff_max_s!r}")
        if self.db_spin_us is not None:
            check_db_spin_us(self.db_spin_us)

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

    def max_poll_interval_s(self) -> float:
        """The consumer's ``max.poll.interval.ms``, in seconds (librdkafka checked its value)."""
        return float(self.kafka_properties.get("max.poll.interval.ms", DEFAULT_MAX_POLL_INTERVAL_MS)) / 1000

    def consumer_kafka(self) -> dict[str, Any]:
        """The consumer's librdkafka configuration."""
        config: dict[str, Any] = {**DEFAULT_CONSUMER, **self.kafka_properties, **self.shared_kafka()}
        config["group.id"] = self.group
        config.update(REQUIRED_CONSUMER)
        return config
