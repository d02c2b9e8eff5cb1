"""A DBA detaches one of the coming days' partitions (ALTER TABLE outbox DETACH PARTITION).

Before: partition maintenance listed the attached partitions only, ran CREATE TABLE IF NOT
EXISTS for the detached one's day (skipped: the name is taken) and reported it created, at
every run (`partitions_maintained created=[...]`, `cleanup`'s "partitions created: ..."),
while the day's rows went to outbox_default and the detached table's unpublished rows,
no longer in the outbox, were never published without a word (an ops audit,
/work/opslab/t_detach.py).  Now it is not reported created, and a detached table holding
unpublished rows is a warning naming it and how many it holds."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from relay import migrate
from relay.janitor import Janitor
from relay.partitions import partition_name
from relay.store import Store
from tests.fixtures.outbox import relay_cmd

ROWS, PUBLISHED = 50, 10


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append(("info", event, kw))

    def warning(self, event: str, **kw: Any) -> None:
        self.events.append(("warning", event, kw))

    error = warning


def _detach_a_coming_day(dsn: str) -> str:
    """Rows written for a coming day, some published, then that day's partition detached."""
    migrate.apply(dsn, partitioned=True)
    day = (datetime.now(UTC) + timedelta(days=3)).date()
    name = partition_name(day)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload, created_at) "
                     "SELECT 'orders', 'k' || g, '{}', %s::date + interval '1 hour' "
                     "FROM generate_series(1, %s) AS g", (day, ROWS))
        conn.execute("UPDATE outbox SET published_at = now() WHERE id IN "
                     "(SELECT id FROM outbox ORDER BY id LIMIT %s)", (PUBLISHED,))
        conn.execute(sql.SQL("ALTER TABLE outbox DETACH PARTITION {}").format(sql.Identifier(name)))
    return name


def _attached(dsn: str, name: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhparent = 'outbox'::regclass "
                           "AND inhrelid = to_regclass(%s))", (name,)).fetchone()
    return bool(row and row[0])


def test_a_detached_partition_is_not_reported_created_and_its_pending_rows_are_named(db_dsn):
    name = _detach_a_coming_day(db_dsn)
    store = Store(db_dsn)
    try:
        report = store.maintain_partitions(retention_s=None)
        assert name not in report.created
        assert report.detached == {name: ROWS - PUBLISHED}
        log = _Log()
        Janitor(store, retention_s=None, batch=100, interval_s=0, partitioned=True, log=log).run_once()
    finally:
        store.close()
    assert not _attached(db_dsn, name)  # the DBA's decision stands: the relay does not attach it
    assert not any(name in kw.get("created", []) for _, _, kw in log.events)
    warnings = [(event, kw) for level, event, kw in log.events if level == "warning"]
    assert len(warnings) == 1
    [(event, kw)] = warnings
    assert event == "partition_detached_with_pending_rows"
    assert kw["table"] == name and kw["pending_rows"] == ROWS - PUBLISHED
    assert "never be published" in kw["hint"]


def test_a_detached_partition_without_pending_rows_is_no_warning(db_dsn):
    name = _detach_a_coming_day(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {} SET published_at = now()").format(sql.Identifier(name)))
    store = Store(db_dsn)
    try:
        log = _Log()
        Janitor(store, retention_s=None, batch=100, interval_s=0, partitioned=True, log=log).run_once()
        assert store.maintain_partitions(retention_s=None).detached == {name: 0}
    finally:
        store.close()
    assert [e for e in log.events if e[0] == "warning"] == []


def test_cleanup_says_the_detached_partition_holds_pending_rows(db_dsn):
    name = _detach_a_coming_day(db_dsn)
    done = subprocess.run(relay_cmd("cleanup", "--cleanup-retention-s", "86400"), capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUTBOX_RELAY_DSN": db_dsn,
                                           "OUTBOX_RELAY_LOG_FORMAT": "json"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    [created] = [line for line in done.stdout.splitlines() if line.startswith("partitions created:")]
    assert name not in created
    assert (f"warning: {name} is detached from the outbox and holds {ROWS - PUBLISHED} unpublished rows"
            in done.stderr)
