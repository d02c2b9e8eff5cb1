"""Fixtures of the consumer SDK's integration tests (real PostgreSQL, real broker).

Built on the session fixtures of tests/conftest.py (`pg_server`, `broker`, `db_dsn`,
`topic_name`); the helpers live in `_support.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from consumer_sdk import InboxConfig, InboxConsumer
from consumer_sdk.metrics import ConsumerMetrics
from tests.fixtures.broker import create_topic
from tests.integration.sdk._support import ConsumerThread, migrate_sdk_db


@pytest.fixture
def sdk_db(db_dsn: str) -> str:
    """A fresh, migrated database with the `effects` and `counters` tables."""
    return migrate_sdk_db(db_dsn)


@pytest.fixture
def sdk_topic(broker: Any, topic_name: Callable[[str], str]) -> str:
    """A fresh 3-partition topic and its dead-letter topic (the consumer checks it exists)."""
    name = topic_name("events")
    create_topic(broker.bootstrap, name, partitions=3)
    create_topic(broker.bootstrap, f"{name}.dlq", partitions=1)
    return name


@pytest.fixture
def run_consumer() -> Iterator[Callable[..., ConsumerThread]]:
    """Factory: `run_consumer(config, handler, **kwargs)` starts a ConsumerThread; all are
    stopped after the test."""
    started: list[ConsumerThread] = []

    def make(config: InboxConfig, handler: Any, **kwargs: Any) -> ConsumerThread:
        kwargs.setdefault("metrics", ConsumerMetrics())
        thread = ConsumerThread(InboxConsumer(config, handler, **kwargs)).start()
        started.append(thread)
        return thread

    yield make
    for thread in started:
        if thread.thread.is_alive():
            thread.consumer.stop()
            thread.thread.join(30)


