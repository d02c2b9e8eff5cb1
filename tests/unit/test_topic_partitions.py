"""The relay says when a topic it publishes to changes its partition count
(relay/topic_partitions.py): partitions added move keys between partitions, and per-key
order holds only within each partition from then on.  Kafka warns nobody; SREs debugging
"events out of order" need to find it.

Pure logic with fakes: the first count seen, a change, no change, a failed lookup, only the
topics published to since their last look (at most --metrics-max-topics of them), a round's
time budget; and the producer's side (relay/publisher.py ``partitions_now``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from outbox_core.kafka_clients import destroy_producer
from relay.config import build_settings, producer_config
from relay.metrics import RelayMetrics
from relay.model import OutboxRow
from relay.publisher import PARTITIONS_TTL_S, PARTITIONS_UNKNOWN_S, Publisher
from relay.stalls import default_partition
from relay.topic_partitions import (
    FEWER_HINT,
    MOVED_HINT,
    PartitionChange,
    PartitionWatch,
    published_by_topic,
)
from tests.fixtures.procs import wait_until


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.lines.append((level, event, kw))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [kw for _, name, kw in self.lines if name == event]


class Cluster:
    """Partition counts by topic (None: the lookup fails); records what was asked."""

    def __init__(self, **counts: int | None) -> None:
        self.counts = dict(counts)
        self.asked: list[str] = []

    def __call__(self, topic: str) -> int | None:
        self.asked.append(topic)
        return self.counts.get(topic)


def publish(metrics: RelayMetrics, topic: str, rows: int = 1) -> None:
    """As the pump counts marked rows (relay/pump_settle.py): under the topic's label."""
    metrics.published.labels(metrics.topics.label(topic)).inc(rows)


def watch(cluster: Cluster, metrics: RelayMetrics, log: Log, **kw: Any) -> PartitionWatch:
    return PartitionWatch(partitions=cluster, published=lambda: published_by_topic(metrics),
                          metrics=metrics, log=log, **kw)


def changes_counted(metrics: RelayMetrics, topic: str) -> float | None:
    return metrics.registry.get_sample_value("outbox_relay_topic_partition_changes_total", {"topic": topic})


def test_the_first_count_seen_is_no_change_and_the_same_count_again_is_none() -> None:
    metrics, log, cluster = RelayMetrics(), Log(), Cluster(orders=2)
    w = watch(cluster, metrics, log)
    publish(metrics, "orders")
    assert w.run_once() == [] and w.counts.seen == {"orders": 2}
    publish(metrics, "orders")
    assert w.run_once() == []
    assert cluster.asked == ["orders", "orders"]
    assert log.named("topic_partitions_changed") == [] and changes_counted(metrics, "orders") is None


def count_changed(before: int, after: int) -> tuple[PartitionWatch, RelayMetrics, Log, list[PartitionChange]]:
    """A watch that saw "orders" at ``before`` partitions, then at ``after``: the watch, its
    metrics and log, and the changes its second round said."""
    metrics, log, cluster = RelayMetrics(), Log(), Cluster(orders=before)
    w = watch(cluster, metrics, log)
    publish(metrics, "orders")
    w.run_once()
    cluster.counts["orders"] = after
    publish(metrics, "orders")
    return w, metrics, log, w.run_once()


def test_a_change_is_logged_with_both_counts_and_a_hint_and_counted() -> None:
    w, metrics, log, changes = count_changed(2, 4)
    assert changes == [PartitionChange("orders", 2, 4)]
    (said,) = log.named("topic_partitions_changed")
    assert said == {"topic": "orders", "partitions_before": 2, "partitions_after": 4, "hint": MOVED_HINT}
    assert [level for level, event, _ in log.lines if event == "topic_partitions_changed"] == ["warning"]
    assert "per-key order holds only within each partition" in MOVED_HINT and "Drain" in MOVED_HINT
    assert changes_counted(metrics, "orders") == 1
    publish(metrics, "orders")
    assert w.run_once() == []  # said once: 4 is now the count seen
    assert changes_counted(metrics, "orders") == 1


def test_fewer_partitions_cannot_happen_in_kafka_but_are_said_the_same_way() -> None:
    _, metrics, log, changes = count_changed(6, 3)
    assert changes == [PartitionChange("orders", 6, 3)]
    (said,) = log.named("topic_partitions_changed")
    assert said["partitions_before"] == 6 and said["partitions_after"] == 3 and said["hint"] == FEWER_HINT
    assert changes_counted(metrics, "orders") == 1


def test_a_failed_lookup_is_no_change_and_the_topic_is_asked_again_next_round() -> None:
    metrics, log, cluster = RelayMetrics(), Log(), Cluster(orders=2)
    w = watch(cluster, metrics, log)
    publish(metrics, "orders")
    w.run_once()
    cluster.counts["orders"] = None  # the cluster unreachable, the topic not authorized ...
    publish(metrics, "orders")
    assert w.run_once() == [] and w.counts.seen == {"orders": 2}
    cluster.counts["orders"] = 4
    assert w.run_once() == [PartitionChange("orders", 2, 4)]  # nothing published since: still due
    assert cluster.asked == ["orders"] * 3


def test_only_topics_published_to_since_their_last_look_are_asked() -> None:
    metrics, log, cluster = RelayMetrics(), Log(), Cluster(a=1, b=1)
    w = watch(cluster, metrics, log)
    assert w.run_once() == [] and cluster.asked == []  # nothing published yet
    publish(metrics, "a")
    publish(metrics, "b")
    w.run_once()
    publish(metrics, "b", 3)
    cluster.asked.clear()
    w.run_once()
    assert cluster.asked == ["b"]
    cluster.asked.clear()
    w.run_once()
    assert cluster.asked == []  # an idle relay asks nothing


def test_topics_are_bounded_by_the_metrics_topic_label_bound() -> None:
    metrics, log = RelayMetrics(max_topics=2), Log()
    cluster = Cluster(**{f"tenant{i}": 3 for i in range(50)})
    w = watch(cluster, metrics, log)
    for i in range(50):  # a writer minting a topic per row
        publish(metrics, f"tenant{i}")
    w.run_once()
    assert sorted(cluster.asked) == ["tenant0", "tenant1"]  # the labelled ones; not "_other"
    assert len(w.counts.seen) == 2


def test_a_round_stops_asking_after_its_budget_and_the_rest_go_first_next_round() -> None:
    now = [0.0]

    class SlowCluster(Cluster):
        def __call__(self, topic: str) -> int | None:
            now[0] += 1.0  # an unreachable cluster: each lookup takes its timeout, and fails
            return super().__call__(topic)

    metrics, log, cluster = RelayMetrics(), Log(), SlowCluster()
    w = watch(cluster, metrics, log, budget_s=2.5, clock=lambda: now[0])
    for topic in "abcde":
        publish(metrics, topic)
    w.run_once()
    assert cluster.asked == ["a", "b", "c"]
    cluster.asked.clear()
    w.run_once()
    assert cluster.asked == ["d", "e", "a"]


def test_the_thread_runs_rounds_survives_a_failing_one_and_stops() -> None:
    metrics, log = RelayMetrics(), Log()
    calls = [0]

    def published() -> Mapping[str, float]:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("boom")
        return {}

    w = PartitionWatch(partitions=Cluster(), published=published, metrics=metrics, log=log, every_s=0.01)
    w.start()
    w.start()  # idempotent
    try:
        wait_until(lambda: w.rounds >= 2, timeout_s=5, message=lambda: f"rounds: {w.rounds}, log: {log.lines}")
    finally:
        w.stop()
        w.stop()  # idempotent
    assert w._thread is not None and not w._thread.is_alive()
    (failed,) = log.named("partition_check_failed")
    assert failed["error"] == "RuntimeError: boom"


# --- the producer's side -------------------------------------------------------------------


class Metadata:
    def __init__(self, topic: str, partitions: int | None) -> None:
        self.topics = {} if partitions is None else {
            topic: type("T", (), {"error": None, "partitions": dict.fromkeys(range(partitions))})()}


class MetadataClient:
    """The producer's metadata requests, answered from ``cluster`` (None: the topic not found)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def list_topics(self, *, topic: str, timeout: float) -> Metadata:
        return Metadata(topic, self.cluster(topic))


@contextlib.contextmanager
def publisher_asking(cluster: Cluster, clock: Callable[[], float]) -> Iterator[Publisher]:
    """A Publisher whose metadata requests ``cluster`` answers; closed when the block ends."""
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1:1/x", "bootstrap_servers": "127.0.0.1:1"})
    publisher = Publisher(producer_config(settings), on_client_error=lambda *a: None, clock=clock)
    real, publisher._producer = publisher._producer, MetadataClient(cluster)
    try:
        yield publisher
    finally:
        publisher._producer = real
        publisher.close()


ROW = OutboxRow(id=1, event_id="00000000-0000-7000-8000-000000000001", topic="orders", key="k8",
                value=b"v", headers_json="{}", xid=1, shard=0, attempts=0, created_epoch=0.0, size=1)


def test_partitions_now_gives_partition_of_the_new_count_at_once_and_none_once_closed() -> None:
    cluster = Cluster(orders=2)
    with publisher_asking(cluster, lambda: 100.0) as publisher:
        assert publisher.partition_of(ROW) == default_partition(b"k8", 2)
        cluster.counts["orders"] = 4
        assert publisher.partitions_now("orders") == 4
        cluster.asked.clear()
        # The cached count (trusted 60 s) is the new one, without another request.
        assert default_partition(b"k8", 4) != default_partition(b"k8", 2)  # a key that moves
        assert publisher.partition_of(ROW) == default_partition(b"k8", 4) and cluster.asked == []
    assert publisher.partitions_now("orders") is None  # not a RuntimeError from the closed client


def test_a_failed_lookup_of_the_watch_keeps_the_count_and_one_of_partition_of_is_trusted_5_s() -> None:
    now = [100.0]
    cluster = Cluster(orders=2)
    with publisher_asking(cluster, lambda: now[0]) as publisher:
        assert publisher.partition_of(ROW) == default_partition(b"k8", 2)
        cluster.counts["orders"] = None  # the cluster unreachable, the topic gone ...
        assert publisher.partitions_now("orders") is None
        assert publisher.partition_of(ROW) == default_partition(b"k8", 2)  # the watch's failure forgot nothing
        now[0] += PARTITIONS_TTL_S  # the count expires: partition_of asks, and fails
        assert publisher.partition_of(ROW) is None and cluster.asked == ["orders"] * 3
        cluster.counts["orders"] = 4
        now[0] += PARTITIONS_UNKNOWN_S - 0.5
        assert publisher.partition_of(ROW) is None and cluster.asked == ["orders"] * 3  # not asked again yet
        now[0] += 0.5
        assert publisher.partition_of(ROW) == default_partition(b"k8", 4) and cluster.asked == ["orders"] * 4


def test_close_waits_for_a_lookup_under_way_before_it_destroys_the_client() -> None:
    """librdkafka's handle must not be destroyed under a call in progress on another thread
    (the watch's metadata request): close, on the pump's thread, waits for it."""
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1:1/x", "bootstrap_servers": "127.0.0.1:1"})
    publisher = Publisher(producer_config(settings), on_client_error=lambda *a: None)
    real = publisher._producer
    inside, release = threading.Event(), threading.Event()
    order: list[str] = []

    class SlowClient:
        def list_topics(self, *, topic: str, timeout: float) -> Metadata:
            order.append("lookup begins")
            inside.set()
            release.wait(5)
            order.append("lookup ends")
            return Metadata(topic, 2)

        def __len__(self) -> int:
            return 0

        def close(self) -> None:
            order.append("destroyed")

    publisher._producer = SlowClient()
    looking = threading.Thread(target=publisher.partitions_now, args=("orders",), daemon=True)
    looking.start()
    assert inside.wait(5)
    closing = threading.Thread(target=publisher.close, daemon=True)
    closing.start()
    closing.join(0.3)  # a close that does not wait destroys the client now
    assert closing.is_alive() and order == ["lookup begins"]
    release.set()
    looking.join(5)
    closing.join(5)
    assert order == ["lookup begins", "lookup ends", "destroyed"]
    destroy_producer(real)


def test_between_rounds_only_topics_never_looked_up_are_asked_and_no_round_is_counted() -> None:
    metrics, log, cluster = RelayMetrics(), Log(), Cluster(a=1, b=1)
    w = watch(cluster, metrics, log)
    publish(metrics, "a")
    w.run_once(first_looks=True)
    assert cluster.asked == ["a"] and w.counts.seen == {"a": 1} and w.rounds == 0
    publish(metrics, "a", 5)  # more rows: due at the next round, not in a first look
    publish(metrics, "b")
    cluster.asked.clear()
    w.run_once(first_looks=True)
    assert cluster.asked == ["b"]
    cluster.asked.clear()
    w.run_once()
    assert cluster.asked == ["a"] and w.rounds == 1


def test_partitions_added_soon_after_the_first_send_are_said() -> None:
    """Before: the first look came at the first round, up to every_s (60 s) after the relay
    first sent to the topic, and took a change in that minute for the first count, unsaid.
    Now the thread looks at a topic first published to within FIRST_LOOK_S."""
    metrics, log, cluster = RelayMetrics(), Log(), Cluster(orders=3)
    w = watch(cluster, metrics, log, every_s=3600.0)  # no round during the test
    w.start()
    try:
        publish(metrics, "orders")
        wait_until(lambda: "orders" in w.counts.seen, timeout_s=5, message="no first look at orders")
        cluster.counts["orders"] = 6
        publish(metrics, "orders")
        w.run_once()  # the round
    finally:
        w.stop()
    assert [c["partitions_before"] for c in log.named("topic_partitions_changed")] == [3]
