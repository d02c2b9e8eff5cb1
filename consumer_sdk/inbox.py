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
* When partitions are revoked (all of them; or some, with ``cooperative-sticky`` or
  ``group.protocol=consumer``), their applied offsets are committed first and their
  records in hand are not applied: a batch holding some is interrupted (the records of
  the partitions kept are fetched again), one holding none goes on.  The next owner
  starts from those offsets.  A member that lost its partitions without knowing (paused, evicted)
  cannot apply twice: the inbox's primary key serializes it with the new owner.
* Back-off (handler retries, database outages) keeps the group membership alive:
  the partitions are paused and the consumer keeps polling.  So does one transaction
  longer than ``max.poll.interval.ms``: a keeper thread polls beside it
  (:mod:`~consumer_sdk.inbox_keeper`).

Lifecycle: :meth:`InboxConsumer.start`, :meth:`~InboxConsumer.run_once` (one
batch, returns its :class:`~consumer_sdk.model.BatchResult`), :meth:`~InboxConsumer.run`
(loop until :meth:`~InboxConsumer.stop`), :meth:`~InboxConsumer.close`
(idempotent).  The SDK logs through structlog and never configures logging.

The consumer is built from parts, a module each: this one (construction, lifecycle, the
batch loop), :mod:`~consumer_sdk.inbox_offsets`, :mod:`~consumer_sdk.inbox_group` (the Kafka
consumer, rebalances, keep-alive), :mod:`~consumer_sdk.inbox_parked` and
:mod:`~consumer_sdk.inbox_upkeep` (database waits, retention), with a thread of
:mod:`~consumer_sdk.inbox_keeper` polling beside long transactions, sharing the state declared in
:mod:`~consumer_sdk.inbox_state`.  Import the consumer from here (or ``consumer_sdk``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import structlog
from confluent_kafka import Consumer, KafkaException

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
from consumer_sdk.inbox_group import Abandon, InboxGroup
from consumer_sdk.inbox_keeper import KafkaKeeper
from consumer_sdk.inbox_parked import InboxParked
from consumer_sdk.inbox_upkeep import InboxUpkeep
from consumer_sdk.inbox_waits import LockWaitWatch
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import BatchResult, InboxMessage, KafkaRecord
from consumer_sdk.offsets import OffsetBook, TopicPart
from consumer_sdk.parking import ParkingLot
from consumer_sdk.processor import BatchHandler, Processor, StatementsHandler
from consumer_sdk.rejections import DeadLetterSink, Policies
from consumer_sdk.replays import with_replays
from consumer_sdk.retention import RetentionFinding
from consumer_sdk.store import ConnectionFactory, PgInboxStore, connect_factory
from outbox_core import cgroup
from outbox_core.kafka_errors import TlsListenerProbe
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

#: ``db_waits``' outcomes, in the order of a Spinner's (hits, misses, skipped).
_WAIT_OUTCOMES = ("answered_while_polling", "slept_after_polling", "slept_paused")


class InboxConsumer(InboxGroup, InboxParked, InboxUpkeep):
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
            watch_connect = connect_factory(config.dsn, application_name=f"outbox-consumer:{config.name}"[:57]
                                            + ":watch")
        else:
            watch_connect = connect
        self.store = PgInboxStore(connect)
        self._busy_since: float | None = None  # when the batch in the works began (LockWaitWatch)
        self.lock_waits = LockWaitWatch(watch_connect, session=lambda: self.store.session, log=self.log,
                                        busy_s=lambda: 0.0 if (since := self._busy_since) is None
                                        else self._clock() - since,
                                        wait_gauge=self.metrics.lock_wait.labels(config.name))
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
        self._moved: set[TopicPart] = set()  # revoked or lost since the batch in hand was polled
        self._fatal: str | None = None
        self._answered = False  # a broker answered (an assignment, a record): transport errors may pass
        self._tls_probe = TlsListenerProbe(config.consumer_kafka())  # a plaintext client, a TLS listener
        self._last_client_error: int | None = None
        self._next_cleanup = 0.0
        self._polled_at = clock()
        self._membership_s = config.max_poll_interval_s() / 2
        # Later than the loop's own poll between transactions, so that the two rarely meet.
        self._keeper = KafkaKeeper(self._keep_beside, idle_s=lambda: self._clock() - self._polled_at,
                                   after_s=config.max_poll_interval_s() * 0.6, log=self.log)
        self._closed = False
        self.assigned: set[TopicPart] = set()
        self.retention: list[RetentionFinding] = []
        self.totals = BatchResult()
        self._waits_seen = (0, 0, 0)  # the store's waits counted into db_waits so far

    # -- lifecycle ------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to finish the current batch and return.  Idempotent, thread-safe."""
        self._stop.set()

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
        self.lock_waits.start()
        if self.config.assignment == "subscribe":  # an assigned reader has no membership to keep
            self._keeper.start()
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
            savepoint_per_message=self.config.savepoint_per_message, statements=self._statements,
            between=self._keep_membership, between_due=self._membership_due)

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
        self._keeper.stop()
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
            self.lock_waits.stop()
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
        self._moved = set()
        if wanted > 0:
            timeout_s = 0 if records else self.config.poll_timeout_s
            messages = consumer.consume(num_messages=wanted, timeout=timeout_s)
            self._polled_at = self._clock()
            for msg in messages:
                record = self._accept(msg)
                if record is not None:
                    records.append(record)
            if self._moved:  # a revoke ran inside consume(): what it returned may not be ours any more
                records = self._owned(records)
                self._moved = set()
        if self._fatal is not None:
            raise KafkaFatal(self._fatal)
        return records


    def _process(self, records: Sequence[KafkaRecord]) -> BatchResult:
        """Settle ``records``, waiting out retriable failures; offsets follow each commit."""
        assert self._processor is not None
        started = self._busy_since = self._clock()
        self._unsettled = list(records)
        total = BatchResult()
        failures = 0
        try:
            while self._unsettled and not self.stopping:
                try:
                    if failures:
                        self._busy_since = None  # a back-off is no wait on the database
                        self._sleep(self._db_backoff_s(failures))
                        self._busy_since = self._clock()
                    with self._keeper.lent():  # a transaction longer than max.poll.interval.ms
                        self._processor.process(list(self._unsettled), total)
                except RetriableError as exc:
                    failures += 1
                    self._batch_failed(exc, failures)
                except DeadLetterBlocked as blocked:
                    self._park(blocked)
                except Abandon:
                    break
        finally:
            self._busy_since = None
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
