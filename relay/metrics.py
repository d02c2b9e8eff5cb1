"""Every metric of the relay, declared once, on an injected registry.

Names follow Prometheus conventions with the prefix ``outbox_relay_``; label
values are bounded (error classes, reasons; topics by relay/metric_labels.py): never keys,
payloads or ids.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from math import fsum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from relay.metric_labels import TopicLabels
from relay.options import DEFAULT_METRICS_MAX_TOPICS

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
#: Permanent failure classes of relay.publisher (bounded label values).
KNOWN_FAILURE_CLASSES = ("message_too_large", "record_rejected", "invalid_topic", "unknown_topic",
                         "topic_not_authorized", "bad_headers")
#: What made a sleeping relay claim the rows it woke for (relay/loop.py).
WAKE_REASONS = ("notify", "poll")
#: Exactly-once mode's Kafka transactions, by how each ended (relay/exactly_once.py).
TRANSACTION_RESULTS = ("committed", "aborted", "fenced")
#: The relay loop's statements that a cancel by the server is counted by (relay/app_run.py): a
#: claim, a rewind's sweep, the lease heartbeat (renewing, giving back, taking shards), another
#: one of the loop's (a failed row's record, a dead letter).  Marks are counted on their own.
CANCELLED_STATEMENTS = ("claim", "sweep", "heartbeat", "other")
BATCH_BUCKETS = (1, 5, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


def observe_many(histogram: Histogram, values: Iterable[float]) -> None:
    """``histogram.observe(v)`` for each value, one increment per bucket and one for the sum.

    A drain observes tens of thousands of latencies a second; one ``observe`` each cost
    a tenth of the relay's time in a profile.  Uses prometheus_client's bucket fields,
    checked against ``observe`` in tests/unit/test_metrics.py; falls back to ``observe``
    if a release renames them.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:
        for value in values:
            histogram.observe(value)
        return
    ordered = sorted(values)
    if not ordered:
        return
    # observe() counts a value in the first bucket whose bound is >= it: over the sorted
    # values, bucket i gets those above bound i-1 and at most bound i (bisects, not a
    # Python step per value).
    below = 0
    for bound, bucket in zip(bounds, buckets, strict=True):
        upto = bisect_right(ordered, bound)
        if upto > below:
            bucket.inc(upto - below)
            below = upto
        if below == len(ordered):
            break
    total.inc(fsum(ordered))


class RelayMetrics:
    """The relay's metrics on ``registry`` (a fresh one per relay in tests).  Rows are
    counted by the label :attr:`topics` gives their topic: the first ``max_topics`` topics
    seen by name, later ones as ``topic="_other"``."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 max_topics: int = DEFAULT_METRICS_MAX_TOPICS) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.topics = TopicLabels(max_topics)
        r = self.registry
        self.published = Counter("outbox_relay_events_published", "Rows acknowledged by the broker and marked published, by topic: the first --metrics-max-topics topics seen by name, later ones together as topic=\"_other\".", ["topic"], registry=r)
        self.publish_errors = Counter("outbox_relay_publish_errors", "Failed publish attempts by error class.", ["error_class"], registry=r)
        self.pending_rows = Gauge("outbox_relay_pending_rows", "Rows not yet published (whole outbox).", registry=r)
        self.oldest_pending_age = Gauge("outbox_relay_oldest_pending_age_seconds", "Age of the oldest unpublished row.", registry=r)
        self.commit_to_ack = Histogram("outbox_relay_commit_to_ack_seconds", "From the row's created_at to the broker's acknowledgement.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.batch_size = Histogram("outbox_relay_batch_size_rows", "Rows per claimed batch.", buckets=BATCH_BUCKETS, registry=r)
        self.claim_duration = Histogram("outbox_relay_claim_duration_seconds", "Duration of one claim query.", buckets=DURATION_BUCKETS_S, registry=r)
        self.mark_duration = Histogram("outbox_relay_mark_duration_seconds", "Duration of one fenced mark statement.", buckets=DURATION_BUCKETS_S, registry=r)
        self.leases_held = Gauge("outbox_relay_leases_held", "Shard leases this replica holds.", registry=r)
        self.leases_lost = Counter("outbox_relay_leases_lost", "Leases found taken over by another replica.", registry=r)
        self.leases_acquired = Counter("outbox_relay_leases_acquired", "Shard leases claimed.", registry=r)
        self.fenced_writes = Counter("outbox_relay_fenced_writes", "Relay writes rejected because the fencing token was stale.", registry=r)
        self.dead_lettered = Counter("outbox_relay_dead_lettered", "Rows moved to the dead letters.", ["reason"], registry=r)
        self.attempts = Counter("outbox_relay_failed_attempts", "Permanent-class failures recorded on rows.", ["reason"], registry=r)
        self.retrying_rows = Gauge("outbox_relay_retrying_rows", "Rows currently in back-off after a failure.", registry=r)
        self.order_violations = Counter("outbox_relay_order_violations", "Rows acknowledged after an earlier row of their key failed (should stay 0).", registry=r)
        self.mark_connection_losses = Counter("outbox_relay_mark_connection_losses", "Mark connections the server ended while the database answered (pg_terminate_backend, idle_session_timeout, a pooler, the network), by connection (application_name): each costs a rewind, its marks in flight published again.", ["connection"], registry=r)
        self.mark_statements_cancelled = Counter("outbox_relay_mark_statements_cancelled", "Mark statements the server cancelled (a statement_timeout shorter than the mark, a lock held longer, pg_cancel_backend), by connection (application_name): each is marked again on its connection after a back-off, split when cancelled again; none is published again.", ["connection"], registry=r)
        self.statements_cancelled = Counter("outbox_relay_statements_cancelled", "Statements of the relay loop the server cancelled while the database answered (a statement_timeout shorter than the statement, a lock on the outbox held longer, pg_cancel_backend), by statement: claim, sweep (a rewind's), heartbeat (the leases'), other. Nothing of them committed; the loop tries again after a back-off (0.5 s doubling up to 2 s) and publishes nothing again. Marks: outbox_relay_mark_statements_cancelled_total.", ["statement"], registry=r)
        self.database_up = Gauge("outbox_relay_database_up", "1 when the last database call succeeded.", registry=r)
        self.lock_wait = Gauge("outbox_relay_lock_wait_seconds", "How long the relay's longest-waiting statement has waited for a database lock (0: none), as last looked at while the relay was held up.", registry=r)
        self.broker_up = Gauge("outbox_relay_broker_up", "0 while the client reports every broker down.", registry=r)
        self.in_flight = Gauge("outbox_relay_in_flight_rows", "Rows produced and not yet acknowledged.", registry=r)
        self.transactions = Counter("outbox_relay_transactions", "Kafka transactions in exactly-once mode, by result (committed, aborted, fenced).", ["result"], registry=r)
        self.queue_full = Counter("outbox_relay_producer_queue_full", "Claims cut short because the producer's local queue was full.", registry=r)
        self.stalled_rows = Gauge("outbox_relay_stalled_rows", "Rows waiting on a partition that acknowledges nothing (its keys' later rows wait too), by topic (as outbox_relay_events_published_total labels it) and partition.", ["topic", "partition"], registry=r)
        self.topic_partition_changes = Counter("outbox_relay_topic_partition_changes", "Partition count changes seen on a topic this relay publishes to, by topic (as outbox_relay_events_published_total labels it; looked at every 60 s): keys moved between partitions, so per-key order holds only within each partition from then on (log: topic_partitions_changed).", ["topic"], registry=r)
        self.last_publish = Gauge("outbox_relay_last_publish_timestamp_seconds", "Unix time of the last marked batch.", registry=r)
        self.db_statements = Counter("outbox_relay_db_statements", "SQL statements the relay sent (idle cost).", registry=r)
        # Asleep, writers NOTIFY the relay (sql/migrations/0003_notify.sql); woken by a poll,
        # it found rows that no notification announced: writers that do not notify (the
        # trigger dropped, rows copied in) wait up to --poll-interval-s for the relay.
        self.sleeping = Gauge("outbox_relay_sleeping", "1 while the relay sleeps: it holds the wake-up lock and writers notify it.", registry=r)
        self.wakeups = Counter("outbox_relay_wakeups", "Times the sleeping relay found rows and woke, by what made it claim: notify (a writer's notification) or poll (the poll interval ran out).", ["reason"], registry=r)
        self.cleanup_deleted = Counter("outbox_relay_cleanup_deleted_rows", "Published rows deleted by retention.", registry=r)
        # Labelled by replay id: only active replays keep a series (removed when done/cancelled).
        self.replay_rows_left = Gauge("outbox_relay_replay_rows_left", "Rows an active replay has still to republish (all shards).", ["replay"], registry=r)
        self.replayed = Counter("outbox_relay_replayed_events", "Rows republished by a replay and acknowledged, by this replica.", ["replay"], registry=r)
        self.build_info = Info("outbox_relay_build", "Build information.", registry=r)
        # Known label values start at 0, so increase() sees the first event of each.
        for reason in KNOWN_FAILURE_CLASSES:
            self.dead_lettered.labels(reason)
            self.attempts.labels(reason)
            self.publish_errors.labels(reason)
        for wake in WAKE_REASONS:
            self.wakeups.labels(wake)
        for transient in ("transient", "timeout", "producer_fatal"):
            self.publish_errors.labels(transient)
        for result in TRANSACTION_RESULTS:  # exactly-once mode's: 0 in the default mode
            self.transactions.labels(result)
        for statement in CANCELLED_STATEMENTS:
            self.statements_cancelled.labels(statement)

    def bound_topics(self, max_topics: int) -> None:
        """Give at most ``max_topics`` topics a label of their own (``--metrics-max-topics``);
        set at start, before a row is counted."""
        self.topics.max_topics = max_topics
