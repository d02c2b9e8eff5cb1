"""A shard's position records (exactly-once mode, issue 20): the topic, and reading them back.

Each transaction of a shard's worker (relay/exactly_once_shard.py) ends with one record in
the shard's partition of the compacted position topic, listing the rows it carried (their
ids and :func:`event_digest`).  :func:`ensure_position_topic` creates the topic at start;
a :class:`PositionReader` (``read_committed``) reads a partition's last committed record
when a worker takes its shard, and refuses one another outbox (or something else) wrote.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.errors import ConfigError
from relay.exactly_once_records import (
    PositionTopicTooSmall,
    merge_parts,
    part_key,
    parts_named,
    read_record_limit,
)
from relay.kafka_producer import _KAFKA_LOG
from relay.marker import MarkStore
from relay.model import Lease, OutboxRow, RowId, ShardId

POSITION_READ_TIMEOUT_S = 20.0
POSITION_TAIL = 64  # offsets read back from the end of a position partition, at first
#: A partition's leader not known yet or moving: its offsets are asked again.
LEADER_MOVING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                 KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION}
OFFSETS_RETRY_S = 0.05
#: Client settings a consumer or an admin client shares with the producer (security, network).
SHARED_PREFIXES = ("bootstrap.servers", "security.", "sasl.", "ssl.", "client.", "socket.",
                   "broker.", "api.version", "metadata.", "topic.metadata", "reconnect.",
                   "enable.ssl", "retry.backoff", "connections.max.idle")


def event_digest(event_id: str) -> int:
    """What a position record lists of a row's event_id: 48 bits of its BLAKE2b digest (the
    whole id made a record of 20,000 rows about 1 MB, the topic's default limit)."""
    return int.from_bytes(hashlib.blake2b(event_id.lower().encode(), digest_size=6).digest(), "big")


def shared_config(config: dict[str, str]) -> dict[str, Any]:
    shared: dict[str, Any] = {k: v for k, v in config.items() if k.startswith(SHARED_PREFIXES)}
    shared["logger"] = _KAFKA_LOG
    return shared


class BrokerUnreachable(Exception):
    """No broker answered (or in time): waited for, like the relay's own producer's."""


#: Errors of a position read that mean the position topic (or the shard's partition) is gone.
POSITION_MISSING = {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC}
#: Errors of an admin request that mean no broker answered, not a refusal.
UNANSWERED = {KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._RESOLVE,
              KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT}


@dataclass(frozen=True, slots=True)
class PositionTopic:
    """What :func:`ensure_position_topic` found: whether it created the topic, and the
    largest position record it takes (:func:`relay.exactly_once_records.read_record_limit`),
    which the caller hands to the publisher (no module keeps it)."""

    created: bool
    record_limit_bytes: int


def ensure_position_topic(config: dict[str, str], topic: str, nshards: int,
                          timeout_s: float = 5.0) -> PositionTopic:
    """Create the compacted position topic (one partition per shard) when missing
    (``created``) and read its record size limit; a clear ConfigError when it has too few
    partitions or may not be created, :class:`PositionTopicTooSmall` when it takes no record
    of one row (``created`` when this call created it), and BrokerUnreachable when no broker
    answered."""
    admin = AdminClient(shared_config(config))
    try:
        found = admin.list_topics(timeout=timeout_s).topics.get(topic)  # no auto-creation
    except KafkaException as exc:
        if exc.args[0].code() in UNANSWERED:
            raise BrokerUnreachable(f"cannot read metadata of {topic}: {exc.args[0].str()}") from None
        raise ConfigError(f"exactly-once: cannot read metadata of {topic}: {exc.args[0].str()}") from None
    if found is not None and found.error is None and found.partitions:
        if len(found.partitions) < nshards:
            raise ConfigError(
                f"exactly-once: position topic {topic} has {len(found.partitions)} partitions, "
                f"fewer than the {nshards} shards; add partitions or name another topic "
                f"(--exactly-once-position-topic)")
        return PositionTopic(False, read_record_limit(admin, config, topic, timeout_s))
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=nshards, replication_factor=-1,
                  config={"cleanup.policy": "compact"})],
        operation_timeout=timeout_s, request_timeout=timeout_s)
    try:
        futures[topic].result(timeout=timeout_s)
    except KafkaException as exc:
        err = exc.args[0]
        if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:  # a peer created it meanwhile
            return ensure_position_topic(config, topic, nshards, timeout_s)
        if err.code() in UNANSWERED:
            raise BrokerUnreachable(f"cannot create the position topic {topic}: {err.str()}") from None
        raise ConfigError(
            f"exactly-once: cannot create the position topic {topic} ({nshards} partitions, "
            f"cleanup.policy=compact): {err.str()}; create it or grant CREATE on it") from None
    try:
        return PositionTopic(True, read_record_limit(admin, config, topic, timeout_s))
    except PositionTopicTooSmall as exc:
        raise PositionTopicTooSmall(str(exc), created=True) from None


class ForeignPosition(Exception):
    """A shard's position record was written by another outbox's relay, or is not one a
    relay wrote: a person must act (the relay stops, nothing marked)."""


@dataclass(frozen=True, slots=True)
class Position:
    """What a shard's last committed position record says."""

    ids: list[RowId]  # the rows it lists ([]: no record)
    writer: str | None  # the outbox that wrote it (None: no record, or one from before 0013)
    end: int  # the partition's high watermark when the read began
    #: Each listed row's :func:`event_digest` (None: a record written before they were listed).
    events: list[int] | None = None


class PositionReader:
    """A ``read_committed`` consumer of one shard's position partition, kept open from the
    read before ``init_transactions`` to the check after it (one client, one connection)."""

    def __init__(self, config: dict[str, str], topic: str, shard: ShardId,
                 timeout_s: float = POSITION_READ_TIMEOUT_S) -> None:
        self._tp = TopicPartition(topic, shard)
        self._timeout_s = timeout_s
        self._consumer = Consumer({**shared_config(config),
                                   "group.id": f"outbox-relay-pos-{uuid.uuid4().hex}",
                                   "enable.auto.commit": False, "isolation.level": "read_committed",
                                   "enable.partition.eof": True, "auto.offset.reset": "earliest",
                                   "fetch.wait.max.ms": 50})

    def _offsets(self) -> tuple[int, int]:
        """The partition's low and high watermarks, asked again while its leader is not
        known yet (a position topic just created: the broker answers "not leader" for a
        moment) or is moving, until the read's timeout."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                low, high = self._consumer.get_watermark_offsets(
                    self._tp, timeout=max(0.1, deadline - time.monotonic()), cached=False)
                return int(low), int(high)
            except KafkaException as exc:
                err = exc.args[0]
                if not (err.retriable() or err.code() in LEADER_MOVING) or time.monotonic() >= deadline:
                    raise
            time.sleep(OFFSETS_RETRY_S)

    def end(self) -> int:
        """The partition's high watermark: it moves with every record and every transaction
        marker written to it, committed or not."""
        return self._offsets()[1]

    def read(self) -> Position:
        """The last committed record (read_committed reads up to the last stable offset)."""
        low, high = self._offsets()
        tail = POSITION_TAIL
        while True:
            start = max(low, high - tail)
            last = _last_record(self._consumer, TopicPartition(self._tp.topic, self._tp.partition,
                                                               start), self._timeout_s)
            # A record written in parts (relay.exactly_once_records) is read with all of them.
            if (last is not None and len(last[2]) >= parts_named(last[0])) or start <= low:
                break
            tail *= 8
        if last is None:
            return Position([], None, high)
        value, offset, parts = last
        if value is None:  # a tombstone: nothing listed (a relay writes none)
            return Position([], None, high)
        try:
            record = merge_parts(json.loads(value), parts)
            ids = [RowId(int(i)) for i in record["ids"]]
            events = record.get("events")
            if events is not None:
                if not isinstance(events, list) or len(events) != len(ids):
                    raise ValueError("events do not match ids")
                events = [int(e) for e in events]
            writer = record.get("outbox")
            if writer is not None and not isinstance(writer, str):
                raise ValueError("outbox is not a string")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # JSONDecodeError is a ValueError
            # Retried for ever before, as "KeyError: 'ids'", naming no record, the shard held
            # and its rows pending (an audit of exactly-once mode).
            where = f"{self._tp.topic}[{self._tp.partition}]@{offset}"
            raise ForeignPosition(
                f"exactly-once: the last record of {where} is not a position record a relay wrote "
                f"({type(exc).__name__}: {str(exc)[:120]}): something else writes to the position topic. "
                "Stop it; then, to go on, produce a record {\"ids\": []} to that partition (rows "
                "committed to Kafka whose mark was lost may then be sent again). Nothing was marked") from None
        return Position(ids, writer, high, events)

    def close(self) -> None:
        self._consumer.close()


class RecoveryStore(MarkStore, Protocol):
    """The recovery connection's store (relay.store.Store)."""

    def event_ids(self, ids: list[RowId]) -> list[tuple[RowId, str]]: ...


def mark_listed(store: RecoveryStore, owner: str, lease: Lease, ids: list[RowId],
                events: list[int] | None) -> tuple[set[ShardId], int, int]:
    """Mark the rows a position record lists (``ids``, and ``events``: their event_digest, or
    None in a record from before event ids were listed: read by its ids) that still hold the
    event it names (a database restored from a backup hands published ids out again, to new
    rows), fenced by ``lease``: (the shards still held, rows marked, rows found).  The mark
    goes by each row's (id, event_id) on both layouts: a partitioned outbox may hold two rows
    of one id (relay.sql's mark_published_by_event); the store is set so where the relay makes
    it (app.py)."""
    found = store.event_ids(ids)
    if events is not None:
        listed = set(zip(ids, events, strict=True))
        found = [(i, event_id) for i, event_id in found if (i, event_digest(event_id)) in listed]
    rows = [OutboxRow(id=i, event_id=event_id, topic="", key=None, value=None, headers_json="",
                      xid=0, shard=lease.shard, attempts=0, created_epoch=0.0) for i, event_id in found]
    held, marked = store.mark_published(owner=owner, leases=[lease], rows=rows)
    return held, len(marked), len(found)


def read_position(config: dict[str, str], topic: str, shard: ShardId,
                  timeout_s: float = POSITION_READ_TIMEOUT_S) -> Position:
    """The last committed position record of ``shard``, read once."""
    reader = PositionReader(config, topic, shard, timeout_s)
    try:
        return reader.read()
    finally:
        reader.close()


def _last_record(consumer: Consumer, tp: TopicPartition,
                 timeout_s: float) -> tuple[bytes | None, int, list[bytes | None]] | None:
    """Read from ``tp`` to the end (read_committed: the last stable offset): the last
    record's value and offset, and the values of the part records just before it (its
    transaction's, when it was written in parts)."""
    consumer.assign([tp])
    last: tuple[bytes | None, int, list[bytes | None]] | None = None
    run: list[bytes | None] = []  # the part records since the last record
    part_prefix = part_key(tp.partition, 0)[:-1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # One message at a time: consume(n, timeout) waits out its timeout unless n came,
        # and a tail of a few records and the end of the partition cost every shard's
        # hand-over the whole 0.2 s.
        msg = consumer.poll(0.2)
        if msg is None:
            continue
        err = msg.error()
        if err is None:
            if (msg.key() or b"").startswith(part_prefix):
                run.append(msg.value())
            else:
                last, run = (msg.value(), msg.offset() or 0, run), []
        elif err.code() == KafkaError._PARTITION_EOF:
            return last
        elif err.fatal() or not err.retriable():
            raise KafkaException(err)
    raise TimeoutError(f"position partition {tp.topic}[{tp.partition}] not read within {timeout_s} s")
