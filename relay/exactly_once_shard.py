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

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from outbox_core.kafka_clients import destroy_producer
from relay.errors import LeaseLost

# The position records (the topic, their reading) live in relay/exactly_once_position.py; the
# names other modules and the tests import from here are re-exported.
from relay.exactly_once_position import POSITION_MISSING, ForeignPosition, PositionReader
from relay.exactly_once_position import POSITION_TAIL as POSITION_TAIL
from relay.exactly_once_position import BrokerUnreachable as BrokerUnreachable
from relay.exactly_once_position import Position as Position
from relay.exactly_once_position import ensure_position_topic as ensure_position_topic
from relay.exactly_once_position import event_digest as event_digest
from relay.exactly_once_position import read_position as read_position
from relay.exactly_once_records import DEFAULT_LIMIT_BYTES, encode_position, produce_position
from relay.kafka_producer import _KAFKA_LOG, await_cluster
from relay.model import OutboxRow, RowId, ShardId, Token
from relay.outcomes import Outcome, classify, refused_at_produce

INIT_TIMEOUT_S = 30.0  # init_transactions waits for the previous holder's transaction to end
COMMIT_TIMEOUT_S = 30.0
DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000  # librdkafka's transaction.timeout.ms
PURGED_REPORTS_WAIT_S = 2.0  # the reports of a producer's purged messages, waited for at its end
FENCED_CODES = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}

Headers = list[tuple[str, str | bytes | None]]


def transaction_timeout_s(config: dict[str, str]) -> float:
    """The producer's ``transaction.timeout.ms`` in seconds (librdkafka's default: 60 s)."""
    try:
        return max(0.001, float(config.get("transaction.timeout.ms", DEFAULT_TRANSACTION_TIMEOUT_MS)) / 1000.0)
    except ValueError:  # librdkafka refuses it when the producer is made
        return DEFAULT_TRANSACTION_TIMEOUT_MS / 1000.0


def timed_out_text(open_s: float, timeout_s: float, error: str, undelivered: int = 0) -> str:
    """Why a transaction open longer than ``transaction.timeout.ms`` failed.  The broker aborts
    it for its timeout and fences the producer's epoch, which librdkafka reports as "fenced by
    a newer instance" (or its messages as timed out) although no other producer need exist.
    Messages not delivered in that time (librdkafka caps message.timeout.ms at it) say a
    partition had no leader or a broker was out of reach: the text blamed only a hold-up of
    the relay (an audit on three Apache Kafka brokers, a partition's only replica killed)."""
    also = (f"; or, {undelivered} of its messages not delivered, a partition had no leader or a "
            f"broker was out of reach" if undelivered else "")
    return (f"the transaction timed out (open {open_s:.1f} s, transaction.timeout.ms "
            f"{timeout_s * 1000:.0f} ms: the relay was held up, paused or starved of CPU{also}) and "
            f"was aborted; its rows are sent again (librdkafka: {error})")


#: The position record's delivery report, beside the rows' (no row has this id).
POSITION_REPORT = RowId(-1)

Recover = Callable[[ShardId, Token, list[RowId], "list[int] | None"], None]


class SentRows:
    """The rows of open transactions handed to Kafka, and whether their partition's leader
    took them (a delivery report without an error: written to its log, not committed yet).

    Shard workers note them on their threads, while their commit waits; the pump's thread
    asks (relay.stalls: only a row handed over and not taken waits on its partition; one
    still buffered, or delivered, waits on its shard's transaction) and forgets a
    transaction's rows when its result is applied."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[RowId, tuple[ShardWorker, bool]] = {}  # -> (worker, delivered)

    def note(self, row_id: RowId, worker: ShardWorker, *, delivered: bool) -> None:
        with self._lock:
            self._by[row_id] = (worker, delivered)

    def undelivered(self, row_id: RowId) -> bool:
        """Handed to Kafka and not delivered (no report yet, or a failed one)."""
        with self._lock:
            found = self._by.get(row_id)
        return found is not None and not found[1]

    def forget(self, rows: list[OutboxRow], worker: ShardWorker) -> None:
        """A transaction's result is in: its rows have outcomes (not a newer worker's)."""
        with self._lock:
            for row in rows:
                found = self._by.get(row.id)
                if found is not None and found[0] is worker:
                    del self._by[row.id]


@dataclass(slots=True)
class Job:
    rows: list[tuple[OutboxRow, Headers]]
    position: list[tuple[RowId, int]]  # what the position record lists: (id, event_digest)
    callbacks: dict[RowId, Any]  # the pump's; only handed back, never called here
    limit_bytes: int = DEFAULT_LIMIT_BYTES  # a position record's largest size (with its overhead)


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
    #: The sizes of position records the broker refused as too large (relay.exactly_once_records).
    position_refused: list[int] = field(default_factory=list)
    error: str = ""


class ShardWorker:
    """The thread and transactional producer of one (shard, lease token)."""

    def __init__(self, shard: ShardId, token: Token, *, config: dict[str, str],
                 transactional_id: str, position_topic: str, recover: Recover,
                 results: queue.SimpleQueue[Result], outbox: str,
                 sent: SentRows | None = None) -> None:
        self.shard, self.token = shard, token
        self._sent = sent if sent is not None else SentRows()
        self._config = {**config, "transactional.id": transactional_id}
        self._timeout_s = transaction_timeout_s(config)
        self._position_topic = position_topic
        self._outbox = outbox  # written into each position record, checked on reading one
        self._recover = recover
        self._results = results
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._producer: Producer | None = None
        self._unfinished = False  # init_transactions or a transaction begun and not ended
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
        self._end_producer()

    def _end_producer(self) -> None:
        """End the producer now, its threads joined and the reports of what it still held
        served (as failures): their callbacks hold the rows, payloads and all, and a client
        freed with reports unserved kept them (``flush(0)`` served only those already in).
        Idle, it ends by :func:`destroy_producer`.  Not when ``init_transactions`` or a
        transaction could not be ended (timed out, the broker away): confluent-kafka's
        ``close()`` aborts the open transaction first, without a bound (over 90 s, until the
        broker came back, measured); then its messages are purged and their reports served
        here, and the client goes with its last reference (``rd_kafka_destroy`` aborts
        nothing)."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        if not self._unfinished:
            destroy_producer(producer)
            return
        try:
            producer.purge()
            deadline = time.monotonic() + PURGED_REPORTS_WAIT_S
            while len(producer) and time.monotonic() < deadline:
                producer.poll(0.05)
        except Exception:  # noqa: BLE001, S110 - a producer in a fatal state may raise SystemError
            pass

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
            self._unfinished = True
            self._producer.init_transactions(INIT_TIMEOUT_S)
            self._unfinished = False
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

        def report(row_id: RowId) -> Callable[[KafkaError | None, Message], None]:
            def done(err: KafkaError | None, msg: Message) -> None:
                reports[row_id] = (Outcome(ok=True, partition=msg.partition() or 0,
                                           offset=msg.offset() or 0)
                                   if err is None else classify(err))
                if err is None and row_id != POSITION_REPORT:
                    self._sent.note(row_id, self, delivered=True)  # before the commit: the pump asks
            return done

        failed_row: tuple[RowId, Outcome] | None = None
        began = time.monotonic()  # the broker's timer starts later, at the first partition added
        try:
            self._unfinished = True
            producer.begin_transaction()
            for row, headers in job.rows:
                self._sent.note(row.id, self, delivered=False)
                problem = self._produce(producer, row, headers, report(row.id))
                if problem is not None:
                    failed_row = (row.id, problem)
                    break
            if failed_row is not None:  # nothing of this transaction may commit
                raise KafkaException(KafkaError(KafkaError._STATE, failed_row[1].message))
            # The event ids too: a row id alone may name another row by the time the record
            # is read (a database restored from a backup hands its ids out again).
            records = encode_position(job.position, token=self.token, outbox=self._outbox,
                                      limit_bytes=job.limit_bytes)
            produce_position(producer, self._position_topic, self.shard, records,
                             report(POSITION_REPORT), result.position_refused)
            producer.commit_transaction(COMMIT_TIMEOUT_S)
            self._unfinished = False
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            result.error = err.str() if failed_row is None else failed_row[1].message
            result.fenced = err.code() in FENCED_CODES
            result.timed_out = (failed_row is None and time.monotonic() - began >= self._timeout_s
                                and (result.fenced or err.txn_requires_abort()))  # not "outcome unknown"
            if result.timed_out:
                try:
                    producer.poll(0)  # the reports already in: messages that timed out
                except Exception:  # noqa: BLE001, S110 - a fenced producer raises its fatal error here
                    pass
                undelivered = sum(1 for own in reports.values() if own.error_class == "timeout")
                result.error = timed_out_text(time.monotonic() - began, self._timeout_s, result.error, undelivered)
            if err.fatal() or result.fenced:
                result.broken = True
            elif err.retriable() and not err.txn_requires_abort():
                result.broken = True  # commit outcome unknown: a new producer's init settles it
            else:
                try:
                    producer.abort_transaction(COMMIT_TIMEOUT_S)
                    self._unfinished = False
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
