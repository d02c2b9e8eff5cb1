"""The dedup consumer: each event's effect happens once, however often Kafka delivers it.

For every batch of messages (one message unless ``batch_size > 1``), the
:class:`~consumer_sdk.processor.Processor` opens one database transaction,
inserts each ``event_id`` into the inbox and calls the handler with the same
connection only when the insert happened, then commits.  Only then does this
loop commit the Kafka offsets (``commit(asynchronous=False)``; auto commit and
auto offset store are off).  The guarantees:

* A crash before the database commit leaves neither the effect nor the offset:
  the message comes again and is applied.  A crash between the database commit
  and the offset commit leaves the effect without the offset: the message comes
  again and is dropped as a duplicate.  Either way, the effect exists once.
* Offsets never pass a message that is not settled (applied, dropped, dead-lettered
  or skipped by policy), and a partition's messages are settled in order.
* When partitions are revoked, their applied offsets are committed first; the
  rest of an interrupted batch is left to the next owner, which starts from those
  offsets.  A member that lost its partitions without knowing (paused, evicted)
  cannot apply twice: the inbox's primary key serializes it with the new owner.
* Back-off (handler retries, database outages) keeps the group membership alive:
  the partitions are paused and the consumer keeps polling.

Lifecycle: :meth:`InboxConsumer.start`, :meth:`~InboxConsumer.run_once` (one
batch, returns its :class:`~consumer_sdk.model.BatchResult`), :meth:`~InboxConsumer.run`
(loop until :meth:`~InboxConsumer.stop`), :meth:`~InboxConsumer.close`
(idempotent).  The SDK logs through structlog and never configures logging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import structlog
from confluent_kafka import (
    OFFSET_STORED,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from consumer_sdk import kafka
from consumer_sdk.config import DEFAULT_DB_SPIN_US, InboxConfig
from consumer_sdk.dead_letters import KafkaDeadLetters
from consumer_sdk.errors import (
    ConfigError,
    DatabaseUnavailable,
    DeadLetterBlocked,
    KafkaFatal,
    RetriableError,
)
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import BatchResult, DeadLetter, InboxMessage, KafkaRecord
from consumer_sdk.offsets import OffsetBook, TopicPart
from consumer_sdk.parking import ParkingLot
from consumer_sdk.processor import BatchHandler, Processor, StatementsHandler
from consumer_sdk.rejections import DeadLetterSink, Policies
from consumer_sdk.replays import with_replays
from consumer_sdk.retention import (
    RetentionFinding,
    check_retention,
    cleanup_inbox,
    report_retention,
)
from consumer_sdk.store import ConnectionFactory, PgInboxStore, connect_factory
from outbox_core import cgroup
from outbox_core.backoff import backoff_s
from outbox_core.kafka_errors import TlsListenerProbe, setup_failure
from outbox_core.secrets import scrub
from outbox_core.spin import default_budget_us

#: The handler: apply one message with ``conn``, inside the consumer's transaction.
#: Never commit.  Raise to roll back and retry; raise PermanentError to dead-letter now.
Handler = Callable[[psycopg.Connection[Any], InboxMessage], None]
#: Or a batch handler (``batch_handler=``): apply every new message of a batch at once
#: (one statement for all), with ``conn``, inside the consumer's transaction.  Same rules;
#: when it raises, the batch's messages are applied one at a time (``[message]``), each in
#: a savepoint of its own, so that the failure concerns its own message only.
#: Or a statements handler (``statements=``): a function of the message alone returning
#: the statements that apply it, ``[(query, params), ...]``.  One message at a time
#: (``batch_size=1``), the inbox row, these statements and the COMMIT then go to the server
#: in one round trip, against two for a handler; a duplicate or a failing statement writes
#: nothing there, and the message goes the handler's way (the statements executed one by
#: one), which applies the policies.  PostgreSQL logs the duplicate's unique_violation.

_KEEPALIVE_POLL_S = 0.2
#: ``db_waits``' outcomes, in the order of a Spinner's (hits, misses, skipped).
_WAIT_OUTCOMES = ("answered_while_polling", "slept_after_polling", "slept_paused")


class _Abandon(Exception):
    """The rest of the batch is left unsettled (a rebalance moved partitions, or stop())."""


class InboxConsumer:
    """One member of a consumer group (or a lone assign() reader) applying events exactly once.

    Not thread-safe, except :meth:`stop`, which any thread or signal handler may call.
    """

    def __init__(self, config: InboxConfig, handler: Handler | None = None, *,
                 batch_handler: BatchHandler | None = None, statements: StatementsHandler | None = None,
                 metrics: ConsumerMetrics | None = None,
                 log: Any = None, connect: ConnectionFactory | None = None,
                 dead_letters: DeadLetterSink | None = None, sleep: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(config, InboxConfig):
            raise ConfigError(f"config must be an InboxConfig, got {type(config).__name__}")
        given = {"handler": handler, "batch_handler": batch_handler, "statements": statements}
        if sum(h is not None for h in given.values()) != 1:
            raise TypeError("give one of a handler, a batch_handler or statements")
        for what, fn in given.items():
            if fn is not None and not callable(fn):
                raise ConfigError(f"{what} must be callable (a function of the connection and the message), "
                                  f"got {fn!r}")
        if connect is None and not config.dsn.strip():
            raise ConfigError("InboxConfig.dsn is empty: give a libpq connection string, or pass connect=")
        if connect is not None and not callable(connect):
            raise ConfigError(f"connect must be callable (a connection factory), got {type(connect).__name__}")
        self.config = config
        self.metrics = metrics if metrics is not None else ConsumerMetrics()
        self.log = (log if log is not None else structlog.get_logger("consumer_sdk.inbox")).bind(
            consumer=config.name)
        if connect is None:  # the consumer's own connections: they poll by the budget and the CPU limit
            spin_us, limit = default_budget_us(config.db_spin_us, DEFAULT_DB_SPIN_US, cgroup.cpu_limit_cores)
            if limit is not None:
                self.log.info("db_spin_off", cpu_limit_cores=round(limit, 3),
                              hint="this process may use less than one core: waits for the database sleep at "
                                   "once (set InboxConfig.db_spin_us to poll anyway)")
            connect = connect_factory(config.dsn, application_name=f"outbox-consumer:{config.name}"[:63],
                                      spin_s=spin_us / 1e6)
        self.store = PgInboxStore(connect)
        self._handler = handler
        self._batch_handler = batch_handler
        self._statements = statements
        self._dead_letters = dead_letters
        self._own_dead_letters: KafkaDeadLetters | None = None
        self._sleep = sleep or self._keepalive_sleep
        self._clock = clock
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._processor: Processor | None = None
        self.offsets = OffsetBook()
        self.parked = ParkingLot(backoff_initial_s=config.db_backoff_initial_s,
                                 backoff_max_s=config.db_backoff_max_s)
        self._unsettled: list[KafkaRecord] = []
        self._deferred: set[TopicPart] = set()  # settled partitions whose offsets wait for the poll's end
        self._stash: list[KafkaRecord] = []  # messages a keep-alive poll returned, processed next
        self._rebalances = 0
        self._fatal: str | None = None
        self._answered = False  # a broker answered (an assignment, a record): transport errors may pass
        self._tls_probe = TlsListenerProbe(config.consumer_kafka())  # a plaintext client, a TLS listener
        self._last_client_error: int | None = None
        self._next_cleanup = 0.0
        self._closed = False
        self.assigned: set[TopicPart] = set()
        self.retention: list[RetentionFinding] = []
        self.totals = BatchResult()
        self._waits_seen = (0, 0, 0)  # the store's waits counted into db_waits so far

    # -- lifecycle ------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to finish the current batch and return.  Idempotent, thread-safe."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        """Wait for the database, check the schema, join the group (or assign), check retention."""
        if self._closed:
            raise RuntimeError("this consumer was closed; build a new one")
        if self._consumer is not None:
            return
        if self._retry_db(self.store.check_schema) is None and self.stopping:
            return
        probe = getattr(self.store, "probe_pooler", None)
        if probe is not None:
            pooled = self._retry_db(probe)
            if pooled is None and self.stopping:
                return
            if pooled:
                self.log.info("transaction_pooler", hint="psycopg's automatic prepared statements are off "
                                                         "for this consumer's connections")
        if self._retry_db(lambda: self.store.bind_group(consumer=self.config.name, group=self.config.group)) \
                is None and self.stopping:
            return
        # The consumer first: an error in kafka_properties is the consumer's own, and was
        # reported as the dead-letter producer's, made first with the same properties.
        consumer = kafka.build_consumer({**self.config.consumer_kafka(), "error_cb": self._client_error})
        try:
            self._processor = self._new_processor()
            self._join(consumer)
        except BaseException:
            consumer.close()
            raise
        self._consumer = consumer
        if self._own_dead_letters is not None and self.config.check_dead_letter_topics \
                and self.config.may_dead_letter():
            kafka.require_topics(self._consumer, self.config.dead_letter_topics(), what="dead-letter topic",
                                 hint="create it (as large a max.message.bytes as its source) or "
                                      "set dead_letter_topic")
        if self.config.check_retention and self.config.inbox_retention_s is not None:
            self._check_retention()
        self.log.info("consumer_started", group=self.config.group, topics=list(self.config.topics),
                      assignment=self.config.assignment, batch_size=self.config.batch_size)

    def _new_processor(self) -> Processor:
        sink = self._dead_letters
        if sink is None:
            sink = self._own_dead_letters = KafkaDeadLetters(
                self.config.dead_letter_kafka(), topic_template=self.config.dead_letter_topic,
                timeout_s=self.config.dead_letter_timeout_s)
        return Processor(
            consumer=self.config.name, store=with_replays(self.store, self.config.apply_replays),
            handler=self._handler, dead_letters=sink,
            policies=Policies(retry=self.config.retry, on_invalid_event_id=self.config.on_invalid_event_id,
                              on_payload_mismatch=self.config.on_payload_mismatch),
            metrics=self.metrics, log=self.log, sleep=self._sleep, on_settled=self._settled,
            batch_size=self.config.batch_size, batch_handler=self._batch_handler,
            savepoint_per_message=self.config.savepoint_per_message, statements=self._statements)

    def run(self) -> None:
        """Start, then settle batches until :meth:`stop`; always closes.  Fatal errors propagate."""
        try:
            self.start()
            while not self.stopping:
                self.run_once()
        finally:
            self.close()

    def close(self) -> None:
        """Commit what was applied, leave the group, close the clients.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        consumer, self._consumer = self._consumer, None
        try:
            if consumer is not None:
                self._commit_pending(consumer, None)
                consumer.close()
        except (KafkaException, RuntimeError) as exc:
            self.log.warning("consumer_close_failed", error=str(exc))
        finally:
            if self._own_dead_letters is not None:
                self._own_dead_letters.close()
            self.store.close()
            self.log.info("consumer_stopped", applied=self.totals.applied, duplicates=self.totals.duplicates)

    # -- one batch ------------------------------------------------------------------------

    def run_once(self) -> BatchResult:
        """Poll one batch and settle it; run the inbox cleanup when due.  Returns what happened."""
        self.start()
        parked = self._retry_parked() if self.parked else BatchResult()
        records = self._poll()
        result = self._process(records) if records else BatchResult()
        result.add(parked)
        self._maybe_cleanup()
        return result

    def _poll(self) -> list[KafkaRecord]:
        consumer = self._live()
        records, self._stash = self._stash, []
        wanted = self.config.poll_records - len(records)
        if wanted > 0:
            timeout_s = 0 if records else self.config.poll_timeout_s
            for msg in consumer.consume(num_messages=wanted, timeout=timeout_s):
                record = self._accept(msg)
                if record is not None:
                    records.append(record)
        if self._fatal is not None:
            raise KafkaFatal(self._fatal)
        return records

    def _accept(self, msg: Message) -> KafkaRecord | None:
        err = msg.error()
        if err is None:
            self._answered = True
            return kafka.record_of(msg)
        refused = self._refused(err.code(), msg.topic(), err.str())
        if err.fatal() or refused is not None:
            self._fatal = refused or self._kafka_text(err)
        elif err.code() != KafkaError._PARTITION_EOF:
            self.log.warning("kafka_consume_error", error=self._kafka_text(err), topic=msg.topic(),
                             partition=msg.partition())
        return None

    def _process(self, records: Sequence[KafkaRecord]) -> BatchResult:
        """Settle ``records``, waiting out retriable failures; offsets follow each commit."""
        assert self._processor is not None
        started = self._clock()
        self._unsettled = list(records)
        total = BatchResult()
        failures = 0
        while self._unsettled and not self.stopping:
            try:
                if failures:
                    self._sleep(self._db_backoff_s(failures))
                self._processor.process(list(self._unsettled), total)
            except RetriableError as exc:
                failures += 1
                self._batch_failed(exc, failures)
            except DeadLetterBlocked as blocked:
                self._park(blocked)
            except _Abandon:
                break
        if self._deferred:
            self._commit_deferred()
        if self._unsettled:
            self.log.info("batch_abandoned", unsettled=len(self._unsettled), stopping=self.stopping)
            if not self.stopping:  # close() commits what was applied; nothing is fetched again
                self._rewind(self._unsettled)
            self._unsettled = []
        self._count_waits()
        self.metrics.batch_duration.labels(self.config.name).observe(self._clock() - started)
        self.metrics.batch_size.labels(self.config.name).observe(len(records))
        self.totals.add(total)
        self.log.debug("inbox_batch", messages=len(records), applied=total.applied,
                       duplicates=total.duplicates, dead_lettered=total.dead_lettered)
        return total

    def _count_waits(self) -> None:
        """Add the store's waits on polling connections since the last batch to ``db_waits``
        (once a batch, not a wait: the counts are the connections' own plain integers, kept
        across reconnections by the store)."""
        counts: tuple[int, int, int] | None = getattr(self.store, "waits", None)  # a store of another kind: none
        if counts is None:
            return
        for outcome, count, seen in zip(_WAIT_OUTCOMES, counts, self._waits_seen, strict=True):
            if count > seen:
                self.metrics.db_waits.labels(self.config.name, outcome).inc(count - seen)
        self._waits_seen = counts

    def _batch_failed(self, exc: RetriableError, failures: int) -> None:
        self.metrics.database_errors.labels(self.config.name).inc()
        if isinstance(exc, DatabaseUnavailable):
            self.store.reset()
        log = self.log.warning if failures == 1 else self.log.debug
        log("batch_retrying", error=str(exc), error_type=type(exc).__name__, failures=failures,
            unsettled=len(self._unsettled))

    def _db_backoff_s(self, failures: int) -> float:
        c = self.config
        return backoff_s(failures, initial_s=c.db_backoff_initial_s, max_s=c.db_backoff_max_s, jitter=0)

    # -- offsets --------------------------------------------------------------------------

    def _settled(self, records: Sequence[KafkaRecord]) -> None:
        """Called by the processor after each database commit: commit the offsets now, or,
        one-at-a-time, once the poll's last message is applied (see ``prefetch_records``)."""
        del self._unsettled[: len(records)]
        if self.config.poll_records == self.config.batch_size:
            self._commit_settled(records)
        else:
            self._deferred |= self.offsets.settle(records)

    def _commit_deferred(self) -> None:
        parts, self._deferred = self._deferred, set()
        consumer = self._live()
        self._commit_pending(consumer, None)
        self._update_lag(consumer, parts & self.assigned)

    def _commit_settled(self, records: Sequence[KafkaRecord]) -> None:
        parts = self.offsets.settle(records)
        consumer = self._live()
        self._commit_pending(consumer, None)
        self._update_lag(consumer, parts)

    def _rewind(self, abandoned: Sequence[KafkaRecord]) -> None:
        """Seek each partition this member keeps back to its first abandoned record.

        An incremental rebalance (``group.protocol=consumer``, KIP-848) revokes only some
        partitions: the kept ones are not reset to their committed offsets, and their
        fetch positions are already past the abandoned records, which a later commit
        would skip.  Records of those partitions fetched meanwhile are dropped (they
        come again after the seek)."""
        first: dict[TopicPart, int] = {}
        for record in abandoned:
            key = (record.topic, record.partition)
            if key in self.assigned and key not in self.parked:
                first[key] = min(first.get(key, record.offset), record.offset)
        if not first:
            return
        self._stash = [r for r in self._stash if (r.topic, r.partition) not in first]
        consumer = self._live()
        for key, offset in first.items():
            kafka.seek(consumer, key, offset, log=self.log)
        self.log.info("partitions_rewound", positions={f"{t}[{p}]": o for (t, p), o in first.items()})

    def _commit_pending(self, consumer: Consumer, only: set[TopicPart] | None) -> None:
        due = self.offsets.due(only)
        if not due:
            return
        done, errors = kafka.commit_offsets(consumer, due)
        for key, offset in done.items():
            self.offsets.confirm(key, offset)
        if errors:  # harmless for the effects: the inbox drops what comes again
            self.metrics.offset_commit_failures.labels(self.config.name).inc()
            self.log.warning("offset_commit_failed", errors=errors)

    def _update_lag(self, consumer: Consumer, parts: set[TopicPart]) -> None:
        for key in parts:
            high = kafka.high_watermark(consumer, key)
            if high is not None:
                lag = self.offsets.lag(key, high)
                self.metrics.lag.labels(self.config.name, key[0], str(key[1])).set(lag)

    # -- the Kafka consumer, rebalances and keep-alive --------------------------------------

    def _live(self) -> Consumer:
        if self._consumer is None:
            raise RuntimeError("the consumer is not started (or already closed)")
        return self._consumer

    def _join(self, consumer: Consumer) -> None:
        """Subscribe (join the group), or assign every partition of the topics."""
        if self.config.assignment == "subscribe":
            consumer.subscribe(list(self.config.topics), on_assign=self._on_assign,
                               on_revoke=self._on_revoke, on_lost=self._on_lost)
        else:
            parts = [TopicPartition(t, p, OFFSET_STORED) for t in self.config.topics
                     for p in kafka.wait_partitions(consumer, t, stop=self._stop, log=self.log,
                                                    refused=self._refused, fatal=lambda: self._fatal)]
            self._answered = bool(parts)
            consumer.assign(parts)
            self.assigned = {(tp.topic, tp.partition) for tp in parts}

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._answered = True
        self._rebalances += 1
        self.metrics.rebalances.labels(self.config.name, "assign").inc()
        self.assigned |= {(tp.topic, tp.partition) for tp in partitions}
        self.log.info("partitions_assigned", partitions=kafka.names(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Commit what was applied on the revoked partitions, then forget them."""
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        self._commit_pending(consumer, revoked)
        self._forget(revoked, "revoke")
        # librdkafka keeps a partition's pause flag across revoke and re-assign: a
        # partition revoked during a back-off would come back paused and silent.
        consumer.resume(partitions)
        self.log.info("partitions_revoked", partitions=kafka.names(partitions))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._forget({(tp.topic, tp.partition) for tp in partitions}, "lost")
        consumer.resume(partitions)  # as in _on_revoke: never come back paused
        self.log.warning("partitions_lost", partitions=kafka.names(partitions))

    def _forget(self, parts: set[TopicPart], kind: str) -> None:
        # A stale applied offset must never be committed later over the next owner's progress.
        self._rebalances += 1
        self.metrics.rebalances.labels(self.config.name, kind).inc()
        self.offsets.forget(parts)
        self.parked.forget(parts)
        self.metrics.dead_letter_blocked.labels(self.config.name).set(len(self.parked))
        for key in parts:
            try:
                self.metrics.lag.remove(self.config.name, key[0], str(key[1]))
            except KeyError:
                pass
        self._stash = [r for r in self._stash if (r.topic, r.partition) not in parts]
        self.assigned -= parts

    def _client_error(self, err: KafkaError) -> None:
        text = self._kafka_text(err)
        # librdkafka retries a rejected password, or a TLS set-up that cannot work, for ever.
        failure = (setup_failure(err.code(), text, answered=self._answered)
                   or self._tls_probe.failure(err.code(), text, answered=self._answered))
        if failure is not None or err.fatal():
            if self._fatal is None:  # once: librdkafka repeats it at each try
                self._fatal = failure or text
                self.log.error("kafka_fatal", error=self._fatal)
        elif err.code() != self._last_client_error:
            self.log.warning("kafka_client_error", error=self._kafka_text(err))
        self._last_client_error = err.code()

    def _refused(self, code: int, topic: str | None, text: str) -> str | None:
        """The line naming the ACL this consumer lacks on its own group or topics, or None."""
        props = self.config.kafka_properties
        return kafka.access_refused(code, topic, group=self.config.group, topics=self.config.topics,
                                    properties=props, text=scrub(text, properties=props))

    def _kafka_text(self, err: KafkaError) -> str:
        """librdkafka's text, which may quote a secret property's value (a malformed
        sasl.oauthbearer.config, from where its parsing stopped), masked."""
        return scrub(err.str(), properties=self.config.kafka_properties)

    def _keepalive_sleep(self, duration_s: float) -> None:
        """Wait with the partitions paused, polling so the group keeps this member.

        Raises :class:`_Abandon` on :meth:`stop` or when a rebalance happened meanwhile.
        """
        if self._deferred:  # what was applied before the back-off is not held back by it
            self._commit_deferred()
        consumer = self._live()
        generation = self._rebalances
        paused = consumer.assignment()
        if paused:
            consumer.pause(paused)
        try:
            deadline = self._clock() + duration_s
            while (left := deadline - self._clock()) > 0:
                if self.stopping:
                    raise _Abandon()
                msg = consumer.poll(min(left, _KEEPALIVE_POLL_S))
                if msg is not None:
                    record = self._accept(msg)
                    if record is not None:  # fetched before the pause took effect: keep it for later
                        self._stash.append(record)
                if self._rebalances != generation or self.stopping:
                    raise _Abandon()
        finally:
            current = [tp for tp in consumer.assignment() if (tp.topic, tp.partition) not in self.parked]
            if current:
                consumer.resume(current)

    # -- dead letters that could not be produced ---------------------------------------------

    def _park(self, blocked: DeadLetterBlocked) -> None:
        """Pause the letter's partition right after its record; drop what was fetched after it."""
        letter = blocked.letter
        assert isinstance(letter, DeadLetter)
        key = self.parked.park(letter, now=self._clock())
        consumer = self._live()
        self._unsettled = [r for r in self._unsettled if (r.topic, r.partition) != key]
        self._stash = [r for r in self._stash if (r.topic, r.partition) != key]
        tp = TopicPartition(key[0], key[1])
        consumer.pause([tp])
        kafka.seek(consumer, key, blocked.offset + 1, log=self.log)
        self.metrics.dead_letter_blocked.labels(self.config.name).set(len(self.parked))
        self.log.error("partition_paused", reason="dead_letter_failed", topic=key[0], partition=key[1],
                       offset=blocked.offset, error=str(blocked))

    def _retry_parked(self) -> BatchResult:
        """Send the parked letters that are due; settle and resume each one that went."""
        assert self._processor is not None
        result = BatchResult()
        for key, parked in self.parked.due(self._clock()):
            try:
                self._processor.send_dead_letter(parked.letter, result)
            except DeadLetterBlocked:
                self.parked.failed(key, now=self._clock())
                continue
            self.parked.release(key)
            result.settled += 1
            self._commit_settled([parked.letter.record])
            self._live().resume([TopicPartition(key[0], key[1])])
            self.log.info("partition_resumed", topic=key[0], partition=key[1], failures=parked.failures)
        self.metrics.dead_letter_blocked.labels(self.config.name).set(len(self.parked))
        return result

    # -- database waits, retention ----------------------------------------------------------

    def _retry_db(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` until the database answers (or stop()); returns its value or None."""
        failures = 0
        while not self.stopping:
            try:
                value = call()
                return True if value is None else value
            except DatabaseUnavailable as exc:
                failures += 1
                if failures == 1:
                    self.log.warning("database_unavailable", error=str(exc))
                self.store.reset()
                self._stop.wait(self._db_backoff_s(failures))
        return None

    def _check_retention(self) -> None:
        try:
            self.retention = check_retention({"logger": kafka.LIBRDKAFKA_LOG, **self.config.shared_kafka()},
                                             list(self.config.topics),
                                             self.config.inbox_retention_s)
        except Exception as exc:  # noqa: BLE001 - a missing check must not stop the consumer
            self.log.warning("inbox_retention_unchecked", error=str(exc))
            return
        report_retention(self.retention, consumer=self.config.name, metrics=self.metrics, log=self.log)

    def _maybe_cleanup(self) -> int:
        retention_s = self.config.inbox_retention_s
        now = self._clock()
        if retention_s is None or now < self._next_cleanup:
            return 0
        self._next_cleanup = now + self.config.cleanup_interval_s
        try:
            deleted = cleanup_inbox(self.store, consumer=self.config.name, retention_s=retention_s,
                                    batch=self.config.cleanup_batch)
        except RetriableError as exc:
            self.log.warning("inbox_cleanup_failed", error=str(exc))
            return 0
        if deleted:
            self.metrics.inbox_cleanup_deleted.labels(self.config.name).inc(deleted)
            self.log.info("inbox_cleaned", deleted=deleted, retention_s=retention_s)
        return deleted

