"""A producer replaced after a fatal idempotence error (``Publisher.recreate``) is destroyed
at once, its threads joined, after the reports of its unacknowledged rows were served (as
failures: the rows stay pending).  It was purged, flush(0)ed and dropped: the purged in-flight
rows' reports came after flush(0), to a client destroyed by then, and were never served (their
batch never settled).  Real tansu behind a proxy that holds the rows in flight."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator

import pytest

from relay.config import build_settings, producer_config
from relay.model import OutboxRow
from relay.publisher import Outcome, Publisher
from tests.fixtures.broker import TansuBroker, create_topic
from tests.fixtures.procs import rdkafka_threads, wait_until
from tests.fixtures.proxy import TcpProxy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def row(n: int, topic: str) -> OutboxRow:
    return OutboxRow(id=n, event_id=f"00000000-0000-7000-8000-{n:012d}", topic=topic, key=f"k{n % 7}",
                     value=b"v", headers_json="{}", xid=1, shard=0, attempts=0, created_epoch=0.0,
                     size=1)


@pytest.fixture
def no_cyclic_collection() -> Iterator[None]:
    """No cyclic collection during the test: a client left in a reference cycle would stay
    alive, so what ends the old client is the code, not the collector's timing."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_recreate_reports_every_unacknowledged_row_and_ends_the_old_client_now(
        proxied_broker: tuple[TansuBroker, TcpProxy], topic_name: Callable[[str], str],
        no_cyclic_collection: None) -> None:
    broker, proxy = proxied_broker
    topic = topic_name("recreate")
    create_topic(broker.bootstrap, topic, partitions=2)
    before = rdkafka_threads()
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1:1/x", "bootstrap_servers": broker.bootstrap})
    publisher = Publisher(producer_config(settings), on_client_error=lambda *a: None)
    reports: dict[int, list[Outcome]] = {}

    def on_delivery(r: OutboxRow, outcome: Outcome) -> None:
        reports.setdefault(r.id, []).append(outcome)

    try:
        assert publisher.warm_up(10.0)
        for n in range(10):
            assert publisher.send(row(n, topic), on_delivery) is None
        assert publisher.flush(10.0) == 0
        assert all(len(reports[n]) == 1 and reports[n][0].ok for n in range(10))
        one_client = rdkafka_threads() - before
        assert one_client >= 2

        proxy.blackhole()  # the next rows go out and are never acknowledged
        for n in range(10, 60):
            assert publisher.send(row(n, topic), on_delivery) is None
        publisher.poll(0.3)
        assert publisher.in_flight() >= 50 and len(reports) == 10

        publisher.recreate()
        # Every unacknowledged row was reported, once, as a failure, before recreate returned.
        assert sorted(reports) == list(range(60))
        assert all(len(reports[n]) == 1 and not reports[n][0].ok for n in range(10, 60))
        assert not any(reports[n][0].permanent or reports[n][0].fatal for n in range(10, 60))

        proxy.restore()
        assert publisher.warm_up(10.0)
        # Only the new client's threads are left: the old one's were joined in recreate.
        wait_until(lambda: rdkafka_threads() - before <= one_client, timeout_s=5.0,
                   message=lambda: (f"{rdkafka_threads() - before} librdkafka threads after recreate, "
                                    f"{one_client} for one client: the old client still runs"))
        assert publisher.send(row(60, topic), on_delivery) is None  # the new client works
        assert publisher.flush(10.0) == 0 and reports[60][0].ok
        assert all(len(outcomes) == 1 for outcomes in reports.values())  # none reported twice
    finally:
        proxy.restore()
        publisher.close()
    assert rdkafka_threads() == before
