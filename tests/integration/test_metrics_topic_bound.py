"""A real relay publishing to more topics than --metrics-max-topics exports no more topic
series than the bound, plus ``topic="_other"`` (relay/metric_labels.py), on the real
PostgreSQL and broker.

Each topic a row named was a series of ``outbox_relay_events_published_total`` for the life
of the process: a topic per tenant, or a writer's bug minting one per row, grew the relay's
/metrics (and every Prometheus scraping it) without bound.  Now the first topics seen keep
their own series and the rest are counted together, every row still counted, said once in
the log."""

from __future__ import annotations

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from relay.app import Relay
from relay.metric_labels import OTHER_TOPICS
from tests.fixtures.broker import create_topic
from tests.fixtures.outbox import RecordingLog, insert_rows, settings, wait_drained
from tests.fixtures.procs import free_port, wait_until

BOUND = 3
ROWS = [5, 6, 7, 8, 9, 10]  # rows of each topic: six topics, twice the bound


def published_by_topic(port: int) -> dict[str, float]:
    """outbox_relay_events_published_total by topic, as /metrics shows it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:  # noqa: S310
        text = response.read().decode()
    return {sample.labels["topic"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "outbox_relay_events_published_total"}


def test_topics_past_the_bound_are_counted_under_other_every_row_counted(outbox_db, broker, topic_name):
    topics = [topic_name(f"tenant{i}") for i in range(len(ROWS))]
    for name, count in zip(topics, ROWS, strict=True):
        create_topic(broker.bootstrap, name, partitions=1)
        insert_rows(outbox_db, name, count, keys=3)
    port, log = free_port(), RecordingLog("topic-bound")
    relay = Relay(settings(outbox_db, broker.bootstrap, metrics_port=port, metrics_max_topics=BOUND,
                           owner="topic-bound"), log=log)
    thread = threading.Thread(target=relay.run, daemon=True, name="relay-topic-bound")
    thread.start()
    try:
        wait_drained(outbox_db, timeout_s=60)
        # The counter moves as the pump collects a mark, just after the commit wait_drained saw.
        wait_until(lambda: sum(published_by_topic(port).values()) >= sum(ROWS), timeout_s=15,
                   message=lambda: f"published counter: {published_by_topic(port)}")
        counted = published_by_topic(port)
    finally:
        relay.stop()
        thread.join(30)
    assert not thread.is_alive(), "relay did not stop"

    rows = dict(zip(topics, ROWS, strict=True))
    own = {topic: value for topic, value in counted.items() if topic != OTHER_TOPICS}
    assert len(own) == BOUND and set(own) <= set(rows), counted
    assert all(value == rows[topic] for topic, value in own.items()), counted  # never relabelled
    assert counted[OTHER_TOPICS] == sum(count for topic, count in rows.items() if topic not in own)
    (said,) = log.named("metrics_topics_folded")
    assert said["max_topics"] == BOUND and said["topic"] in set(rows) - set(own)
