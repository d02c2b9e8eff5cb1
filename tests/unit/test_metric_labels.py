"""The topic label of the relay's metrics is bounded (relay/metric_labels.py): rows naming a
topic each (a topic per tenant, a writer's bug minting one per row) made a Prometheus series
each for the life of the process.  The first ``--metrics-max-topics`` topics seen keep their
own series; later ones are counted under ``topic="_other"``, said once in the log.

Pure logic: the mapping, the option's parsing, and the pump with the fakes of
tests/unit/pump_fakes.py (rows of several topics, one partition without a leader)."""

from __future__ import annotations

from typing import Any

import pytest

from relay.config import DEFAULT_METRICS_MAX_TOPICS, build_settings
from relay.errors import ConfigError
from relay.metric_labels import OTHER_TOPICS, TopicLabels
from relay.metrics import RelayMetrics
from relay.model import OutboxRow
from relay.pump import Pump
from relay.stalls import STALL_AFTER_S
from tests.unit.pump_fakes import Leases, Publisher, Store, row


def test_the_first_topics_seen_keep_their_label_and_later_ones_share_other() -> None:
    labels = TopicLabels(2)
    assert [labels.label(t) for t in ("b", "a", "b", "c", "a", "d", "c")] == \
        ["b", "a", "b", OTHER_TOPICS, "a", OTHER_TOPICS, OTHER_TOPICS]
    assert labels.labelled == 2  # the folded topics are not remembered: no memory per topic
    assert labels.label("e") == OTHER_TOPICS


def test_a_bound_of_zero_counts_every_topic_under_other() -> None:
    labels = TopicLabels(0)
    assert labels.label("a") == OTHER_TOPICS and labels.labelled == 0


def test_no_topic_is_folded_below_the_bound() -> None:
    labels = TopicLabels(3)
    assert [labels.label(t) for t in ("a", "b", "c", "a")] == ["a", "b", "c", "a"]
    assert labels.labelled == 3


@pytest.mark.parametrize(("raw", "expected"), [("3", 3), ("0", 0), (None, DEFAULT_METRICS_MAX_TOPICS)])
def test_the_option_takes_a_number_of_topics(raw: str | None, expected: int) -> None:
    values = {"dsn": "postgresql://db/app", "bootstrap_servers": "k:9092", "metrics_max_topics": raw}
    assert build_settings(values).metrics_max_topics == expected


@pytest.mark.parametrize(("raw", "reason"), [("-1", "must be a number of topics from 0"),
                                             ("many", "is not a whole number"),
                                             ("1.5", "is not a whole number")])
def test_a_bad_bound_is_refused_with_the_option_named(raw: str, reason: str) -> None:
    values = {"dsn": "postgresql://db/app", "bootstrap_servers": "k:9092", "metrics_max_topics": raw}
    with pytest.raises(ConfigError, match=f"--metrics-max-topics / OUTBOX_RELAY_METRICS_MAX_TOPICS: "
                                          f"'{raw}' {reason}"):
        build_settings(values)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


class Log:
    """Records every event with its fields."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append((event, kw))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [kw for event, kw in self.events if event == name]


def topical(start: int, count: int, topics: int) -> list[OutboxRow]:
    """Rows ``start``... over topics t0..t<topics-1> (row i in topic t<i % topics>), key k<i>."""
    return [row(i, 0, key=f"k{i}")._replace(topic=f"t{i % topics}") for i in range(start, start + count)]


def pump_of(rows: list[OutboxRow], publisher: Publisher, max_topics: int) -> tuple[Pump, Store, Log, RelayMetrics, Clock]:
    store, log, clock = Store(rows), Log(), Clock()
    metrics = RelayMetrics(max_topics=max_topics)
    pump = Pump(store=store, publisher=publisher, leases=Leases(shards=[0]), nshards=1,  # type: ignore[arg-type]
                batch_size=10, pipeline_depth=2, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=metrics, log=log, clock=clock)
    return pump, store, log, metrics, clock


def series(metrics: RelayMetrics, name: str) -> dict[tuple[str, ...], float]:
    return {tuple(sorted(s.labels.values())): s.value for family in metrics.registry.collect()
            for s in family.samples if s.name == name}


def test_published_rows_are_all_counted_under_at_most_the_bound_and_other() -> None:
    pump, store, log, metrics, _ = pump_of(topical(1, 50, topics=5), Publisher(), max_topics=2)
    for _ in range(20):
        pump.run_once()
    assert sorted(store.marked) == list(range(1, 51))
    # Rows 1, 2 come first: t1 and t2 keep their series; t3, t4, t0 are folded.
    assert series(metrics, "outbox_relay_events_published_total") == {
        ("t1",): 10, ("t2",): 10, (OTHER_TOPICS,): 30}
    (said,) = log.named("metrics_topics_folded")
    assert said["max_topics"] == 2 and said["topic"] == "t3"
    assert "--metrics-max-topics" in said["detail"]


def test_a_stall_on_folded_topics_is_gauged_under_other_and_logged_by_topic() -> None:
    publisher = Publisher(partition_of=lambda r: 0, no_leader=0)  # every row waits on partition 0
    pump, store, log, metrics, clock = pump_of(topical(1, 12, topics=3), publisher, max_topics=1)
    for _ in range(5):
        pump.run_once()
    clock.now += STALL_AFTER_S
    for _ in range(5):
        pump.run_once()
        clock.now += 0.1
    assert store.marked == []
    stalled = series(metrics, "outbox_relay_stalled_rows")
    assert set(stalled) == {("0", "t1"), ("0", OTHER_TOPICS)}, stalled
    assert sum(stalled.values()) == sum(pump.stalls.named.values()) > stalled[("0", "t1")]
    assert {kw["topic"] for kw in log.named("partition_stalled")} == {"t0", "t1", "t2"}
    assert len(log.named("metrics_topics_folded")) == 1

    publisher.no_leader = None  # the leader is back: every series of the gauge goes
    for _ in range(20):
        pump.run_once()
        clock.now += 0.1
    assert sorted(store.marked) == list(range(1, 13))
    assert series(metrics, "outbox_relay_stalled_rows") == {}
    assert sum(series(metrics, "outbox_relay_events_published_total").values()) == 12
