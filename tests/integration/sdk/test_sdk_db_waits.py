"""The consumer's waits for the database on a polling connection (``db_spin_us``) are
counted in ``outbox_consumer_db_waits_total`` by outcome, once a batch, on a real
PostgreSQL and broker; a consumer that does not poll exports no such series."""

from __future__ import annotations

import uuid
from typing import Any

from tests.integration.sdk._support import make_config, produce_raw, record_effect, wait_settled

OUTCOMES = ("answered_while_polling", "slept_after_polling", "slept_paused")


def _consume(sdk_db: str, broker: Any, topic: str, run_consumer: Any, *, count: int,
             spin_us: float) -> tuple[Any, str]:
    """``count`` new messages applied one at a time by a consumer with ``db_spin_us=spin_us``;
    its thread and its name."""
    produce_raw(broker.bootstrap, topic, [(b"k", b'{"n": %d}' % i, [("event_id", str(uuid.uuid4()).encode())])
                                          for i in range(count)])
    config = make_config(sdk_db, broker, topic, db_spin_us=spin_us)
    thread = run_consumer(config, record_effect)
    wait_settled(thread, count)
    return thread, config.name


def _waits(thread: Any, name: str) -> dict[str, float]:
    return {outcome: thread.sample("outbox_consumer_db_waits_total", consumer=name, outcome=outcome)
            for outcome in OUTCOMES}


def test_a_polling_consumer_counts_its_waits_by_outcome(sdk_db: str, broker: Any, sdk_topic: str,
                                                       run_consumer: Any) -> None:
    # A 10 ms budget: a local PostgreSQL answers every short statement within it.
    thread, name = _consume(sdk_db, broker, sdk_topic, run_consumer, count=20, spin_us=10_000)
    spinner = thread.consumer.store.spinner
    # Two round trips a message at least; a slow machine may leave a few answers past 10 ms.
    assert spinner is not None and spinner.hits >= 30
    waits = _waits(thread, name)
    # Counted once a batch: what the last batch's end saw, never more than the connection did.
    assert waits["answered_while_polling"] >= 30
    assert waits["answered_while_polling"] <= spinner.hits
    assert waits["slept_after_polling"] <= spinner.misses and waits["slept_paused"] <= spinner.skipped


def test_a_consumer_that_does_not_poll_exports_no_waits(sdk_db: str, broker: Any, sdk_topic: str,
                                                        run_consumer: Any) -> None:
    thread, name = _consume(sdk_db, broker, sdk_topic, run_consumer, count=5, spin_us=0)
    assert thread.consumer.store.spinner is None
    registry = thread.consumer.metrics.registry
    assert [registry.get_sample_value("outbox_consumer_db_waits_total",
                                      {"consumer": name, "outcome": outcome})
            for outcome in OUTCOMES] == [None, None, None]
