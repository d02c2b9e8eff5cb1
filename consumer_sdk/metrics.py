"""Every metric of the SDK, declared once, on an injected registry.

Names carry the prefix ``outbox_consumer_``; labels are bounded: the consumer's
name, the topic, the partition, a reason from a fixed set.  Never keys, payloads
or ids.  Several consumers of one process share one :class:`ConsumerMetrics` (the
``consumer`` label tells them apart), since a registry accepts each name once.
Counters are incremented only for what a database commit made true (applied,
duplicates) or what really happened (a failed attempt, a dead letter sent).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000)


class ConsumerMetrics:
    """The SDK's metrics on ``registry`` (a fresh private one when not given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ct = ["consumer", "topic"]
        self.processed = Counter(
            "outbox_consumer_processed", "Messages whose handler ran and whose transaction committed.",
            ct, registry=r)
        self.duplicates = Counter(
            "outbox_consumer_duplicates_dropped", "Messages dropped because the inbox already held their event_id.",
            ct, registry=r)
        self.payload_mismatches = Counter(
            "outbox_consumer_payload_mismatches",
            "Messages whose event_id was applied before with a different body (a producer reused an id).",
            ct, registry=r)
        self.invalid = Counter(
            "outbox_consumer_invalid_messages", "Messages without an event_id header or with one that is not a UUID.",
            ct, registry=r)
        self.handler_errors = Counter(
            "outbox_consumer_handler_errors", "Failed handler attempts (each retry counts).", ct, registry=r)
        self.dead_lettered = Counter(
            "outbox_consumer_dead_lettered", "Messages sent to the dead-letter topic, by reason.",
            ["consumer", "topic", "reason"], registry=r)
        self.dead_letter_failures = Counter(
            "outbox_consumer_dead_letter_failures",
            "Dead letters the broker did not acknowledge (each attempt); the partition waits, paused.",
            ct, registry=r)
        self.dead_letter_blocked = Gauge(
            "outbox_consumer_dead_letter_blocked_partitions",
            "Partitions paused because their dead letter could not be produced yet.",
            ["consumer"], registry=r)
        self.skipped = Counter(
            "outbox_consumer_skipped", "Messages acknowledged without handling by a 'skip' policy, by reason.",
            ["consumer", "topic", "reason"], registry=r)
        self.batch_duration = Histogram(
            "outbox_consumer_batch_duration_seconds", "From receiving a batch to its last offset commit.",
            ["consumer"], buckets=DURATION_BUCKETS_S, registry=r)
        self.batch_size = Histogram(
            "outbox_consumer_batch_messages", "Messages per consumed batch.", ["consumer"],
            buckets=BATCH_BUCKETS, registry=r)
        self.lag = Gauge(
            "outbox_consumer_lag_messages",
            "High watermark minus the next offset to apply, per assigned partition (where the client knows it).",
            ["consumer", "topic", "partition"], registry=r)
        self.offset_commit_failures = Counter(
            "outbox_consumer_offset_commit_failures", "Kafka offset commits that failed (the inbox absorbs the redelivery).",
            ["consumer"], registry=r)
        self.database_errors = Counter(
            "outbox_consumer_database_errors", "Batches retried because the database failed or aborted them.",
            ["consumer"], registry=r)
        self.rebalances = Counter(
            "outbox_consumer_rebalances", "Partition assignments and revocations seen.", ["consumer", "kind"],
            registry=r)
        self.db_waits = Counter(
            "outbox_consumer_db_waits",
            "Waits for the database's answer on a connection that polls first (db_spin_us), by outcome: "
            "answered while polling, polled the whole budget then slept, slept at once (polling paused "
            "after answers kept coming later than the budget).",
            ["consumer", "outcome"], registry=r)
        self.lock_wait = Gauge(
            "outbox_consumer_lock_wait_seconds",
            "How long the consumer's statement has waited on a lock another session holds (the longest "
            "wait its lock-wait watch last saw; 0 when none): a member that left the group with its "
            "transaction open, a DBA's lock.",
            ["consumer"], registry=r)
        self.inbox_cleanup_deleted = Counter(
            "outbox_consumer_inbox_cleanup_deleted_rows", "Inbox rows deleted by retention.", ["consumer"],
            registry=r)
        self.inbox_retention_unsafe = Gauge(
            "outbox_consumer_inbox_retention_unsafe",
            "1 when a topic keeps messages longer than the inbox keeps their ids (a redelivery could apply twice).",
            ["consumer", "topic"], registry=r)
