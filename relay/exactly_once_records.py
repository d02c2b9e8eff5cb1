"""How large a shard's position record may be, and the records a transaction's position is
written as (exactly-once mode; relay/exactly_once.py has the whole design).

A transaction's position lists its rows and the shard's earlier committed rows whose marks
are not confirmed yet, each as its id and 48-bit event digest: up to about 760 KB for 20,000
rows with 19-digit ids.  The broker refuses a record over the position topic's
``max.message.bytes`` (or the producer's ``message.max.bytes``), and a refused record aborted
its transaction, which was retried into the same record for ever: the shard stalled.  So
the position is written as several records when one would not fit: parts (key
``<shard>.part<i>``) and, last, the record recovery reads (key ``<shard>``) naming how many
parts precede it in the same transaction (``parts``, ``txn``).  The rows of a transaction
are never cut for it: the not-yet-confirmed rows alone may fill a record (they are marked
only once their whole claim has settled), so cutting the rows could not bound the record.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType  # type: ignore[attr-defined]

from relay.errors import ConfigError
from relay.kafka_config import max_message_bytes

DEFAULT_LIMIT_BYTES = 1_000_000  # librdkafka's message.max.bytes, the broker's default too
#: Room kept beside a record's value for Kafka's record batch header (61 bytes), the
#: record's own header and key.
RECORD_OVERHEAD_BYTES = 512
#: The longest outbox identity assumed at start, before it is known (uuid/table).
OUTBOX_NAME_ALLOWANCE = 256
#: The broker refused a record as too large (locally: over the producer's message.max.bytes).
TOO_LARGE = {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE}
PART_REPORT_WAIT_S = 30.0  # a part's delivery report waited for (as long as a commit may take)
_WORST_ID = 10**19 - 1
_WORST_DIGEST = 2**48 - 1


def part_key(shard: int, part: int) -> bytes:
    return f"{shard}.part{part}".encode()


class PositionTopicTooSmall(ConfigError):
    """The position topic takes no record of one row: no position can be written to it.
    ``created``: the topic was just created (by :func:`relay.exactly_once_position.ensure_position_topic`)."""

    def __init__(self, message: str, *, created: bool = False) -> None:
        super().__init__(message)
        self.created = created


def read_record_limit(admin: AdminClient, config: Mapping[str, str], topic: str,
                      timeout_s: float) -> int:
    """The largest position record the broker takes (value, key and overhead): the smaller
    of the topic's ``max.message.bytes`` (the broker's ``message.max.bytes`` when the topic
    sets none) and the producer's ``message.max.bytes``; only the producer's when the topic's
    may not be read.  A limit a record of one row exceeds is refused (:class:`PositionTopicTooSmall`)."""
    limit = max_message_bytes(config)
    try:
        future = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)])
        entries = next(iter(future.values())).result(timeout=timeout_s)
        entry = entries.get("max.message.bytes")
        if entry is not None and entry.value is not None:
            limit = min(limit, int(entry.value))
    except (KafkaException, ValueError, TimeoutError, StopIteration):
        pass  # not allowed to describe it (no DescribeConfigs ACL): a refusal halves it later
    needed = smallest_limit_bytes("x" * OUTBOX_NAME_ALLOWANCE)
    if limit < needed:
        raise PositionTopicTooSmall(
            f"exactly-once: the position topic {topic} takes records of at most {limit} bytes "
            f"(its max.message.bytes, or the producer's message.max.bytes if smaller), too small "
            f"for a position record of one row ({needed} bytes with the record's overhead); "
            f"raise max.message.bytes on {topic} (kafka-configs --alter --entity-type topics "
            f"--entity-name {topic} --add-config max.message.bytes=1000000)")
    return limit


def smallest_limit_bytes(outbox: str) -> int:
    """The limit a position record of one worst-case row needs, as a part or as the last one."""
    txn = uuid.UUID(int=0).hex
    headers = (_part_header(outbox, 99_999, txn), _final_header(2**63 - 1, outbox, 99_999, txn))
    return max(len(_encode(h, [(_WORST_ID, _WORST_DIGEST)])) for h in headers) + RECORD_OVERHEAD_BYTES + 16


def encode_position(entries: Sequence[tuple[int, int]], *, token: int, outbox: str,
                    limit_bytes: int) -> list[bytes]:
    """The records a transaction writes to its shard's partition, last the one recovery reads:
    one record as before when it fits in ``limit_bytes`` (with :data:`RECORD_OVERHEAD_BYTES`),
    else parts of at most that size.  ValueError when a record of one row does not fit."""
    budget = limit_bytes - RECORD_OVERHEAD_BYTES
    single = _encode({"token": token, "outbox": outbox}, entries)
    if len(single) <= budget:
        return [single]
    txn = uuid.uuid4().hex
    fixed = max(len(_encode(_part_header(outbox, len(entries), txn), [])),
                len(_encode(_final_header(token, outbox, len(entries), txn), [])))
    chunks = _chunks(entries, budget - fixed)
    records = [_encode(_part_header(outbox, i, txn), chunk) for i, chunk in enumerate(chunks[:-1])]
    records.append(_encode(_final_header(token, outbox, len(chunks) - 1, txn), chunks[-1]))
    return records


def produce_position(producer: Producer, topic: str, shard: int, records: list[bytes],
                     on_delivery: Callable[[KafkaError | None, Message], None],
                     refused: list[int]) -> None:
    """Produce a transaction's position records (:func:`encode_position`) to the shard's
    partition, each part sent before the next is produced: librdkafka would batch them into
    one request over the topic's limit.  The size of a record the broker (or the producer)
    refuses as too large is appended to ``refused``: the publisher cuts the next ones smaller."""

    reported: list[bool] = []

    def done(err: KafkaError | None, msg: Message) -> None:
        if err is not None and err.code() in TOO_LARGE:
            refused.append(len(msg.value() or b""))
        reported.append(True)
        on_delivery(err, msg)

    for number, value in enumerate(records):
        last = number == len(records) - 1
        try:
            producer.produce(topic, value=value, partition=shard, on_delivery=done,
                             key=str(shard).encode() if last else part_key(shard, number))
        except KafkaException as exc:
            if exc.args[0].code() in TOO_LARGE:
                refused.append(len(value))
            raise
        # Not flush(): that waits for every row's delivery too (a partition without a leader).
        deadline = time.monotonic() + PART_REPORT_WAIT_S
        while not last and len(reported) <= number and time.monotonic() < deadline:
            producer.poll(0.01)


def merge_parts(record: dict[str, Any], parts: list[bytes | None]) -> dict[str, Any]:
    """The position a final record and the part records before it list, as one record.
    ValueError when its parts are not all there (the caller reads further back first)."""
    wanted = record.get("parts", 0)
    if not wanted:
        return record
    if not isinstance(wanted, int) or len(parts) < wanted:
        raise ValueError(f"{wanted} parts named, {len(parts)} found before it")
    ids: list[Any] = []
    events: list[Any] = []
    for number, raw in enumerate(parts[len(parts) - wanted:]):
        part = json.loads(raw or b"null")
        if part.get("txn") != record.get("txn") or part.get("part") != number:
            raise ValueError(f"part {number} is not of this record's transaction")
        ids += part["ids"]
        events += part["events"]
    return {**record, "ids": ids + record["ids"], "events": events + record["events"]}


def parts_named(value: bytes | None) -> int:
    """How many part records a final record says precede it (0: none, or not readable)."""
    try:
        wanted = json.loads(value or b"null").get("parts", 0)
    except (ValueError, AttributeError):
        return 0
    return wanted if isinstance(wanted, int) else 0


def _chunks(entries: Sequence[tuple[int, int]], room: int) -> list[list[tuple[int, int]]]:
    """``entries`` cut in order so that each chunk's entries take at most ``room`` bytes (an
    entry: its id and digest and their separators, ``", "`` in each list)."""
    chunks: list[list[tuple[int, int]]] = [[]]
    used = 0
    for entry in entries:
        cost = len(str(entry[0])) + len(str(entry[1])) + 4
        if cost > room:
            raise ValueError(f"a position record of one row does not fit in {room} bytes")
        if used + cost > room:
            chunks.append([])
            used = 0
        chunks[-1].append(entry)
        used += cost
    return chunks


def _part_header(outbox: str, part: int, txn: str) -> dict[str, Any]:
    return {"outbox": outbox, "txn": txn, "part": part}


def _final_header(token: int, outbox: str, parts: int, txn: str) -> dict[str, Any]:
    return {"token": token, "outbox": outbox, "parts": parts, "txn": txn}


def _encode(header: dict[str, Any], entries: Sequence[tuple[int, int]]) -> bytes:
    return json.dumps({**header, "ids": [i for i, _ in entries],
                       "events": [e for _, e in entries]}).encode()
