"""``outbox_consumer_db_waits_total`` keeps the waits of a polling connection that was
replaced (a database failure, a restart): the store adds a dropped connection's counts to
the ones before it, and the consumer counts once a batch from those totals."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from psycopg.pq import TransactionStatus

from consumer_sdk import InboxConfig, InboxConsumer
from consumer_sdk.metrics import ConsumerMetrics
from outbox_core.spin import Spinner


class FakeConn:
    """What the store asks of a connection before it sends anything, and a spinner."""

    def __init__(self) -> None:
        self.closed = self.broken = False
        self.autocommit = True
        self.prepare_threshold: int | None = 5
        self.info = SimpleNamespace(transaction_status=TransactionStatus.IDLE, backend_pid=0,
                                    parameter_status=lambda name: None)
        self.spinner = Spinner(100e-6)

    def close(self) -> None:
        self.closed = True


def answered(consumer: InboxConsumer) -> float | None:
    return consumer.metrics.registry.get_sample_value(
        "outbox_consumer_db_waits_total", {"consumer": "svc", "outcome": "answered_while_polling"})


def test_the_waits_of_a_replaced_connection_since_the_last_batch_are_counted() -> None:
    made: list[FakeConn] = []

    def connect() -> Any:
        made.append(FakeConn())
        return made[-1]

    config = InboxConfig(name="svc", bootstrap_servers="127.0.0.1:1", topics=["t"])
    consumer = InboxConsumer(config, lambda conn, message: None, connect=connect, metrics=ConsumerMetrics())
    first = consumer.store.conn
    first.spinner.hits = 5  # type: ignore[attr-defined]
    consumer._count_waits()  # a batch ended
    assert answered(consumer) == 5

    first.spinner.hits = 8  # type: ignore[attr-defined]  # 3 more, then the connection broke
    first.broken = True  # type: ignore[misc]
    second = consumer.store.conn
    assert second is made[1] and first.closed
    second.spinner.hits = 2  # type: ignore[attr-defined]
    second.spinner.skipped = 4  # type: ignore[attr-defined]
    consumer._count_waits()
    assert answered(consumer) == 10  # 5 + 3 + 2: none lost with the first connection
    assert consumer.metrics.registry.get_sample_value(
        "outbox_consumer_db_waits_total", {"consumer": "svc", "outcome": "slept_paused"}) == 4

    consumer.store.reset()  # dropped, not yet replaced: nothing counted twice
    consumer._count_waits()
    assert answered(consumer) == 10
