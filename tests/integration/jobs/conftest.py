"""Fixtures of the jobs integration tests (real PostgreSQL), built on tests/conftest.py.

`jobs_db` is a fresh database per test (`db_dsn`) migrated by the relay's migrator,
with the test tables of `_support.py`.  `pools` starts WorkerPools and stops them all
after the test, so a failing test never leaves threads claiming in the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import psycopg
import pytest

from consumer_sdk.jobs import Handler, JobsMetrics, WorkerConfig, WorkerPool
from tests.integration.jobs._support import migrate_jobs_db


@pytest.fixture
def jobs_db(db_dsn: str) -> str:
    return migrate_jobs_db(db_dsn)


@pytest.fixture
def conn(jobs_db: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(jobs_db, autocommit=True) as c:
        yield c


@pytest.fixture
def pools(jobs_db: str) -> Iterator[Callable[..., WorkerPool]]:
    started: list[WorkerPool] = []

    def make(handlers: Mapping[str, Handler], **overrides: Any) -> WorkerPool:
        metrics = overrides.pop("metrics", None) or JobsMetrics()
        options: dict[str, Any] = {"dsn": jobs_db, "poll_interval_s": 0.5, "lease_duration_s": 5.0,
                                   "max_concurrency": 2, "drain_timeout_s": 2.0}
        options.update(overrides)
        pool = WorkerPool(WorkerConfig(**options), handlers, metrics=metrics)
        started.append(pool)
        pool.start()
        return pool

    yield make
    for pool in started:
        pool.stop(drain_timeout_s=1.0)
