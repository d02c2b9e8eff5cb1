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




@pytest.fixture
def password_role(own_pg_running: Any) -> Iterator[Any]:
    """A role `pw_sdk` that must log in with the password 'right-password' (restartable server)."""
    from pathlib import Path

    import psycopg

    hba = Path(own_pg_running.data_dir) / "pg_hba.conf"
    original = hba.read_text()
    hba.write_text("host all pw_sdk 127.0.0.1/32 scram-sha-256\n" + original)
    with psycopg.connect(own_pg_running.admin_dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS pw_sdk")
        conn.execute("CREATE ROLE pw_sdk LOGIN PASSWORD 'right-password'")
        conn.execute("SELECT pg_reload_conf()")
    try:
        yield own_pg_running
    finally:
        hba.write_text(original)
        with psycopg.connect(own_pg_running.admin_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("DROP ROLE IF EXISTS pw_sdk")
