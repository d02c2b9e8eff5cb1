"""One shard's transactional producer, on a thread of its own (exactly-once mode, issue 20).

``init_transactions``, ``commit_transaction`` and the position read block, so they run
here and never on the pump's thread.  A worker is started when its shard's lease is
acquired: it reads the shard's last committed position record (``read_committed``),
stopping there if another outbox wrote it, creates the producer (``transactional.id`` =
prefix + table + shard: Kafka fences the previous holder's producer at that moment), reads
the record again if the partition's end moved meanwhile, and hands the ids it lists to
``recover`` (which marks them published, fenced with the new token).  Then it runs one transaction
job at a time: the rows, one position record, commit.  Results go to the publisher's
queue; this thread never calls the pump's callbacks.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.errors import ConfigError, LeaseLost
from relay.model import OutboxRow, RowId, ShardId, Token
from relay.publisher import _KAFKA_LOG, Outcome, await_cluster, classify, refused_at_produce

INIT_TIMEOUT_S = 30.0  # init_transactions waits for the previous holder's transaction to end
COMMIT_TIMEOUT_S = 30.0
POSITION_READ_TIMEOUT_S = 20.0
DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000  # librdkafka's transaction.timeout.ms
POSITION_TAIL = 64  # offsets read back from the end of a position partition, at first
FENCED_CODES = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
#: A partition's leader not known yet or moving: its offsets are asked again.
LEADER_MOVING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                 KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION}
OFFSETS_RETRY_S = 0.05
#: Client settings a consumer or an admin client shares with the producer (security, network).
SHARED_PREFIXES = ("bootstrap.servers", "security.", "sasl.", "ssl.", "client.", "socket.",
                   "broker.", "api.version", "metadata.", "topic.metadata", "reconnect.",
                   "enable.ssl", "retry.backoff", "connections.max.idle")

Headers = list[tuple[str, str | bytes | None]]


def transaction_timeout_s(config: dict[str, str]) -> float:
    """The producer's ``transaction.timeout.ms`` in seconds (librdkafka's default: 60 s)."""
    try:
        return max(0.001, float(config.get("transaction.timeout.ms", DEFAULT_TRANSACTION_TIMEOUT_MS)) / 1000.0)
    except ValueError:  # librdkafka refuses it when the producer is made
        return DEFAULT_TRANSACTION_TIMEOUT_MS / 1000.0


def timed_out_text(open_s: float, timeout_s: float, error: str) -> str:
    """Why a transaction open longer than ``transaction.timeout.ms`` failed.  The broker aborts
    it for its timeout and fences the producer's epoch, which librdkafka reports as "fenced by
    a newer instance" (or its messages as timed out) although no other producer need exist."""
    return (f"the transaction timed out (open {open_s:.1f} s, transaction.timeout.ms "
            f"{timeout_s * 1000:.0f} ms: the relay was held up, paused or starved of CPU) and was "
            f"aborted; its rows are sent again (librdkafka: {error})")


def event_digest(event_id: str) -> int:
    """What a position record lists of a row's event_id: 48 bits of its BLAKE2b digest (the
    whole id made a record of 20,000 rows about 1 MB, the topic's default limit)."""
    return int.from_bytes(hashlib.blake2b(event_id.lower().encode(), digest_size=6).digest(), "big")


Recover = Callable[[ShardId, Token, list[RowId], "list[int] | None"], None]


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


def ensure_position_topic(config: dict[str, str], topic: str, nshards: int,
                          timeout_s: float = 5.0) -> None:
    """Create the compacted position topic (one partition per shard) when missing;
    a clear ConfigError when it has too few partitions or may not be created, and
    BrokerUnreachable when no broker answered."""
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
        return
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
    return None


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
            if last is not None or start <= low:
                break
            tail *= 8
        if last is None:
            return Position([], None, high)
        value, offset = last
        if value is None:  # a tombstone: nothing listed (a relay writes none)
            return Position([], None, high)
        try:
            record = json.loads(value)
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


def read_position(config: dict[str, str], topic: str, shard: ShardId,
                  timeout_s: float = POSITION_READ_TIMEOUT_S) -> Position:
    """The last committed position record of ``shard``, read once."""
    reader = PositionReader(config, topic, shard, timeout_s)
    try:
        return reader.read()
    finally:
        reader.close()


def _last_record(consumer: Consumer, tp: TopicPartition, timeout_s: float) -> tuple[bytes | None, int] | None:
    """Read from ``tp`` to the end (read_committed: the last stable offset): the last
    record's value and offset."""
    consumer.assign([tp])
    last: tuple[bytes | None, int] | None = None
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
            last = msg.value(), msg.offset() or 0
        elif err.code() == KafkaError._PARTITION_EOF:
            return last
        elif err.fatal() or not err.retriable():
            raise KafkaException(err)
    raise TimeoutError(f"position partition {tp.topic}[{tp.partition}] not read within {timeout_s} s")


@dataclass(slots=True)
class Job:
    rows: list[tuple[OutboxRow, Headers]]
    position: list[tuple[RowId, int]]  # what the position record lists: (id, event_digest)
    callbacks: dict[RowId, Any]  # the pump's; only handed back, never called here


@dataclass(slots=True)
class Result:
    """What the worker hands back: a finished init (``rows`` empty) or transaction."""

    worker: ShardWorker
    rows: list[OutboxRow] = field(default_factory=list)
    callbacks: dict[RowId, Any] = field(default_factory=dict)
    outcomes: dict[RowId, Outcome] = field(default_factory=dict)
    listed: dict[RowId, int] = field(default_factory=dict)  # the position record's: id -> event_digest
    ok: bool = False
    init: bool = False
    fenced: bool = False  # Kafka fenced the producer (another holder's, or the timeout's epoch bump)
    #: The transaction was open longer than transaction.timeout.ms: the broker aborted it
    #: (and fenced this producer's epoch) for its timeout, whoever else holds the shard.
    timed_out: bool = False
    broken: bool = False  # this producer cannot go on: a new one must init (and recover)
    foreign: bool = False  # the shard's position record is another outbox's: a person must act
    position_missing: bool = False  # the position topic (or its partition) is not there
    error: str = ""


class ShardWorker:
    """The thread and transactional producer of one (shard, lease token)."""

    def __init__(self, shard: ShardId, token: Token, *, config: dict[str, str],
                 transactional_id: str, position_topic: str, recover: Recover,
                 results: queue.SimpleQueue[Result], outbox: str) -> None:
        self.shard, self.token = shard, token
        self._config = {**config, "transactional.id": transactional_id}
        self._timeout_s = transaction_timeout_s(config)
        self._position_topic = position_topic
        self._outbox = outbox  # written into each position record, checked on reading one
        self._recover = recover
        self._results = results
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._producer: Producer | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"outbox-relay-txn-{shard}")
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """After the job running (if any): close the producer and end the thread.  A worker
        closed before it took the transactional id does not take it."""
        self._closed.set()
        self._jobs.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        result = self._init()
        self._results.put(result)
        # On after a transaction aborted cleanly (a row the broker refused, a topic missing):
        # the pump rewinds and sends this shard's rows again, to this worker.  Ending here,
        # as it did on any failure, left the shard's next job to a thread that was gone: its
        # rows pending for ever, its lease still renewed (an audit of exactly-once mode).
        while not result.broken:
            job = self._jobs.get()
            if job is None:
                break
            result = self._transaction(job)
            self._results.put(result)
        if self._producer is not None:
            try:
                self._producer.flush(0)
            except Exception:  # noqa: BLE001 - best effort on a producer that is done
                pass
            self._producer = None

    def _init(self) -> Result:
        """Read the shard's last position record, then take the transactional id (which
        fences its previous holder's producer), then recover what that record lists.

        The record is read first so that a relay whose outbox shares the topic and the
        transactional ids with another one (both defaults) stops before it fences the other
        outbox's producer: that relay, already running, would lose its transactions and
        its shards and, reading this one's record next, could stop too.  The read holds
        after ``init_transactions`` unless the partition's end moved meanwhile (the
        previous holder's open transaction aborted or completed, or a record written):
        then it is read again."""
        reader: PositionReader | None = None
        try:
            reader = PositionReader(self._config, self._position_topic, self.shard)
            position = reader.read()
            self._refuse_foreign(position.writer)
            config: dict[str, Any] = {**self._config, "logger": _KAFKA_LOG}
            config.setdefault("log.connection.close", "false")
            self._producer = Producer(config)
            # A broker connection up first: init_transactions finding none (the client's
            # bootstrap connection already dropped, the learned broker's not yet up) asks
            # for its coordinator again only on a 500 ms timer (in about one shard
            # hand-over of six on a single-node Apache Kafka).
            await_cluster(self._producer)
            if self._closed.is_set():
                # The shard was released (or lost) while this worker read its position: the
                # id may be another replica's by now, and taking it would fence that one's
                # producer (seen in a rolling restart: its transaction failed and it took the
                # shard back 3 s later).
                return Result(self, init=True, broken=True, error="closed before init_transactions")
            self._producer.init_transactions(INIT_TIMEOUT_S)
            if reader.end() != position.end:
                position = reader.read()
                self._refuse_foreign(position.writer)
            self._recover(self.shard, self.token, position.ids, position.events)
        except KafkaException as exc:
            err = exc.args[0]
            return Result(self, init=True, fenced=err.code() in FENCED_CODES, broken=True,
                          position_missing=reader is not None and err.code() in POSITION_MISSING,
                          error=err.str())
        except ForeignPosition as exc:
            return Result(self, init=True, broken=True, foreign=True, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a database or timeout error: retried later
            return Result(self, init=True, fenced=isinstance(exc, LeaseLost),
                          broken=True, error=f"{type(exc).__name__}: {exc}")
        finally:
            if reader is not None:
                reader.close()
        return Result(self, init=True, ok=True)

    def _refuse_foreign(self, writer: str | None) -> None:
        if writer and writer != self._outbox:
            raise ForeignPosition(
                f"exactly-once: the last position record of shard {self.shard} "
                f"({self._position_topic}[{self.shard}]) was written by another outbox "
                f"({writer}, this one is {self._outbox}): two outboxes share "
                f"--exactly-once-position-topic and --exactly-once-transactional-id-prefix; "
                f"give each its own. Nothing was marked")

    def _transaction(self, job: Job) -> Result:
        assert self._producer is not None
        producer = self._producer
        rows = [row for row, _ in job.rows]
        reports: dict[RowId, Outcome] = {}
        result = Result(self, rows=rows, callbacks=job.callbacks, listed=dict(job.position))

        def report(row: OutboxRow) -> Callable[[KafkaError | None, Message], None]:
            def done(err: KafkaError | None, msg: Message) -> None:
                reports[row.id] = (Outcome(ok=True, partition=msg.partition() or 0,
                                           offset=msg.offset() or 0)
                                   if err is None else classify(err))
            return done

        failed_row: tuple[RowId, Outcome] | None = None
        began = time.monotonic()  # the broker's timer starts later, at the first partition added
        try:
            producer.begin_transaction()
            for row, headers in job.rows:
                problem = self._produce(producer, row, headers, report(row))
                if problem is not None:
                    failed_row = (row.id, problem)
                    break
            if failed_row is not None:  # nothing of this transaction may commit
                raise KafkaException(KafkaError(KafkaError._STATE, failed_row[1].message))
            # The event ids too: a row id alone may name another row by the time the record
            # is read (a database restored from a backup hands its ids out again).
            value = json.dumps({"token": self.token, "ids": [i for i, _ in job.position],
                                "events": [e for _, e in job.position], "outbox": self._outbox}).encode()
            producer.produce(self._position_topic, value=value, key=str(self.shard).encode(),
                             partition=self.shard)
            producer.commit_transaction(COMMIT_TIMEOUT_S)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            result.error = err.str() if failed_row is None else failed_row[1].message
            result.fenced = err.code() in FENCED_CODES
            result.timed_out = (failed_row is None and time.monotonic() - began >= self._timeout_s
                                and (result.fenced or err.txn_requires_abort()))  # not "outcome unknown"
            if result.timed_out:
                result.error = timed_out_text(time.monotonic() - began, self._timeout_s, result.error)
            if err.fatal() or result.fenced:
                result.broken = True
            elif err.retriable() and not err.txn_requires_abort():
                result.broken = True  # commit outcome unknown: a new producer's init settles it
            else:
                try:
                    producer.abort_transaction(COMMIT_TIMEOUT_S)
                except KafkaException:
                    result.broken = True
            cause = "fenced" if result.fenced and not result.timed_out else "transaction_aborted"
            for row in rows:
                own = reports.get(row.id)
                if failed_row is not None and failed_row[0] == row.id:
                    own = failed_row[1]
                result.outcomes[row.id] = (own if own is not None and not own.ok and own.permanent
                                           else Outcome(ok=False, error_class=cause,
                                                        message=result.error))
            return result
        result.ok = True
        for row in rows:
            result.outcomes[row.id] = reports.get(row.id) or Outcome(ok=True)
        return result

    @staticmethod
    def _produce(producer: Producer, row: OutboxRow, headers: Headers,
                 on_delivery: Callable[[KafkaError | None, Message], None]) -> Outcome | None:
        key = row.key.encode() if row.key is not None else None
        refreshed = False
        while True:
            try:
                producer.produce(row.topic, value=row.value, key=key, headers=headers,
                                 on_delivery=on_delivery)
                return None
            except BufferError:
                producer.poll(0.05)  # this thread may wait: the queue drains as batches go
            except KafkaException as exc:
                err = exc.args[0]
                if err.code() == KafkaError._UNKNOWN_TOPIC and not refreshed:
                    refreshed = True
                    try:
                        producer.list_topics(topic=row.topic, timeout=2.0)
                    except KafkaException:
                        pass
                    continue
                if err.fatal() or err.code() in FENCED_CODES or err.txn_requires_abort():
                    raise
                return refused_at_produce(err)
