"""Helpers of the consumer SDK's integration tests: effect tables, producing through the
relay, consumers on threads.

A handler's "effect" is a row in `effects` (no unique constraint, so a double apply shows
as two rows) and an increment of a counter in `counters`.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg

from consumer_sdk import InboxConfig, InboxConsumer, InboxMessage
from relay import migrate
from tests.fixtures.broker import create_topic
from tests.fixtures.outbox import RelayThread, wait_drained
from tests.fixtures.procs import wait_until

#: Group timings that make tansu rebalance in seconds instead of tens of seconds.
FAST_GROUP = {
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 300,
    "max.poll.interval.ms": 30000,
    "fetch.wait.max.ms": 50,
    "logger": logging.getLogger("tests.sdk.kafka"),
}

EFFECTS_DDL = """
CREATE TABLE effects (
    event_id uuid NOT NULL,
    consumer text NOT NULL,
    n        bigint,
    applied  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE counters (name text PRIMARY KEY, value bigint NOT NULL DEFAULT 0);
"""


def migrate_sdk_db(dsn: str) -> str:
    """The relay's schema (outbox, inbox, ...) plus the effect tables of the test handlers."""
    migrate.apply(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS_DDL)
    return dsn


def record_effect(conn: psycopg.Connection[Any], message: InboxMessage, consumer: str = "c") -> None:
    """The canonical effect: one row per application, plus a counter increment."""
    body = message.json()
    n = body.get("n") if isinstance(body, dict) else None
    conn.execute("INSERT INTO effects (event_id, consumer, n) VALUES (%s, %s, %s)",
                 (message.event_id, consumer, n))
    conn.execute("INSERT INTO counters (name, value) VALUES (%s, 1) "
                 "ON CONFLICT (name) DO UPDATE SET value = counters.value + 1", (consumer,))


def effect_counts(dsn: str) -> dict[str, int]:
    """{event_id: number of effect rows}."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT event_id::text, count(*) FROM effects GROUP BY event_id").fetchall()
    return {r[0]: int(r[1]) for r in rows}


def counter(dsn: str, name: str = "c") -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT value FROM counters WHERE name = %s", (name,)).fetchone()
    return int(row[0]) if row else 0


def write_numbered(dsn: str, topic: str, count: int, *, keys: int = 10, start: int = 0,
                   headers: dict[str, str] | None = None) -> list[str]:
    """`count` events with payload {"n": i} through the SDK's write_events; returns the ids."""
    from consumer_sdk import OutboxEvent, write_events

    events = [OutboxEvent(topic=topic, key=f"k{i % keys}", payload={"n": i}, headers=headers)
              for i in range(start, start + count)]
    with psycopg.connect(dsn) as conn:
        ids = write_events(conn, events)
    return [str(i) for i in ids]


def publish_all(dsn: str, bootstrap: str, *, times: int = 1, timeout_s: float = 60.0) -> None:
    """Run the relay until the outbox is drained; `times=2` resets and runs it again,
    so every row reaches Kafka twice (what a crash between ack and mark does)."""
    for round_ in range(times):
        if round_:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("UPDATE outbox SET published_at = NULL")
        with RelayThread(dsn, bootstrap, batch_size=500):
            wait_drained(dsn, timeout_s=timeout_s)


@dataclass
class ConsumerThread:
    """An InboxConsumer running on a thread; `stop()` joins it and re-raises its error."""

    consumer: InboxConsumer
    error: BaseException | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"consumer-{self.consumer.config.name}")

    def _run(self) -> None:
        try:
            self.consumer.run()
        except BaseException as exc:  # noqa: BLE001 - surfaced by stop()
            self.error = exc

    def start(self) -> ConsumerThread:
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.consumer.stop()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "consumer did not stop"
        if self.error is not None:
            raise self.error

    def sample(self, name: str, **labels: str) -> float:
        return self.consumer.metrics.registry.get_sample_value(name, labels) or 0.0


def make_config(dsn: str, broker: Any, topic: str, **overrides: Any) -> InboxConfig:
    values: dict[str, Any] = {
        "name": f"svc-{uuid.uuid4().hex[:8]}",
        "dsn": dsn,
        "bootstrap_servers": broker.bootstrap,
        "topics": [topic],
        "assignment": "assign",
        "poll_timeout_s": 0.2,
        "kafka_properties": dict(FAST_GROUP),
    }
    values.update(overrides)
    return InboxConfig(**values)


def wait_settled(thread: ConsumerThread, count: int, timeout_s: float = 45.0) -> None:
    """Wait until the consumer settled `count` messages (applied + dropped + dead-lettered...)."""
    wait_until(lambda: thread.consumer.totals.settled >= count or thread.error is not None,
               timeout_s=timeout_s,
               message=lambda: f"settled {thread.consumer.totals.settled} of {count}")
    if thread.error is not None:
        raise thread.error


def produce_raw(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]],
                partition: int = 0) -> None:
    """Produce (key, value, headers) messages straight to Kafka, in order, to one partition."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "logger": logging.getLogger("tests.sdk.producer")})
    errors: list[str] = []
    for key, value, headers in messages:
        producer.produce(topic, key=key, value=value, headers=headers, partition=partition,
                         on_delivery=lambda err, _msg: errors.append(str(err)) if err else None)
    assert producer.flush(15) == 0 and not errors, errors


def numbered_events_on_kafka(bootstrap: str, topic: str, count: int) -> list[str]:
    """Create ``topic`` (one partition) and its dead-letter topic, and produce ``count``
    events straight to Kafka, in order: key ``k``, JSON ``{"n": 0..count-1}``, each with a
    fresh ``event_id`` header.  Returns the event ids, in order."""
    create_topic(bootstrap, topic, partitions=1)
    create_topic(bootstrap, f"{topic}.dlq", partitions=1)
    ids = [str(uuid.uuid4()) for _ in range(count)]
    produce_raw(bootstrap, topic, [(b"k", json.dumps({"n": n}).encode(), [("event_id", event_id.encode())])
                                   for n, event_id in enumerate(ids)])
    return ids


def wait_for(predicate: Any, timeout_s: float = 30.0, message: str = "condition not met") -> Any:
    return wait_until(predicate, timeout_s=timeout_s, message=message)


class RoundTrips:
    """Counts a connection's round trips (ReadyForQuery messages, from libpq's protocol
    trace) while the block runs: ``with RoundTrips(conn) as trips: ...; trips.count``."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.count = 0
        self.sent: list[str] = []
        self.lines: list[str] = []  # the whole trace, one protocol message a line

    def __enter__(self) -> RoundTrips:
        import tempfile

        self._file = tempfile.TemporaryFile("w+")
        self.conn.pgconn.trace(self._file.fileno())
        self.conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.conn.pgconn.untrace()
        self._file.seek(0)
        lines = self._file.read().splitlines()
        self._file.close()
        self.lines = lines
        self.count = sum(1 for line in lines if "\tReadyForQuery" in line)
        self.sent = [line.split("\t", 3)[-1] for line in lines
                     if line.startswith("F\t") and ("\tParse\t" in line or "\tQuery\t" in line)]
