"""Partition maintenance under a role that may not read a detached partition.

Contrived (maintenance runs as the outbox's owner), but real: the owner REVOKEs its own
SELECT on a table it detached.  Before: counting that table's unpublished rows raised
permission denied out of maintenance; the relay's cleanup turned partition maintenance off
for good with `partition_maintenance_refused` (a warning about creating partitions, which
it may), the coming days' partitions were no longer created, and `cleanup` exited 1.  Now
that one table is named with the privilege missing, and the attached partitions are
maintained."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay import migrate
from relay.janitor import Janitor
from relay.partitions import partition_name
from relay.store import Store
from tests.fixtures.outbox import relay_cmd
from tests.integration.test_partition_detached import _Log
from tests.integration.test_partitioned import partitions


@pytest.fixture
def owner_dsn(db_dsn: str) -> Iterator[str]:
    """``db_dsn`` as a role of its own (no superuser), which will own the outbox."""
    role = f"outbox_owner_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(role)))
    try:
        yield make_conninfo(db_dsn, user=role)
    finally:
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_unreadable_detached_partition_is_named_and_the_attached_ones_are_maintained(owner_dsn, db_dsn):
    migrate.apply(owner_dsn, partitioned=True)
    now = datetime.now(UTC)
    detached, coming = partition_name((now + timedelta(days=3)).date()), partition_name((now + timedelta(days=5)).date())
    with psycopg.connect(owner_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE outbox DETACH PARTITION {}").format(sql.Identifier(detached)))
        conn.execute(sql.SQL("REVOKE SELECT ON {} FROM CURRENT_USER").format(sql.Identifier(detached)))
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(coming)))  # for maintenance to create
    store, log = Store(owner_dsn), _Log()
    janitor = Janitor(store, retention_s=None, batch=100, interval_s=0, partitioned=True, log=log)
    try:
        janitor.run_once()
    finally:
        store.close()
    assert janitor.partitioned  # maintenance stays on
    assert coming in partitions(db_dsn) and detached not in partitions(db_dsn)
    warnings = [(event, kw) for level, event, kw in log.events if level == "warning"]
    assert [(event, kw["table"], kw["missing_privilege"]) for event, kw in warnings] == [
        ("partition_detached_unreadable", detached, "SELECT")]
    assert f"{detached} is detached from the outbox and this role has no SELECT privilege" in warnings[0][1]["hint"]

    done = subprocess.run(relay_cmd("cleanup", "--cleanup-retention-s", "86400"), capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUTBOX_RELAY_DSN": owner_dsn})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("warning:")] == [
        f"warning: {detached} is detached from the outbox and this role has no SELECT privilege on it: its "
        "unpublished rows, if any, are not counted (and never published); grant SELECT on it to this role, "
        "or look as its owner"]
