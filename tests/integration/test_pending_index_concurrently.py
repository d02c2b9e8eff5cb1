"""migrate builds the claim's index on a large outbox without holding the application's writers.

Before: it ran a plain CREATE INDEX in its transaction whatever the table's size.  That takes
a SHARE lock, and a partial index's build reads the whole table (published rows included):
every INSERT of every writer waited for as long as it read, and, while the build itself
waited behind a writer's open transaction, every writer queued behind it for up to
--lock-timeout-s at each try.  An upgrade's migration job (0001's index giving way to the
shard column's on PostgreSQL 17 and later) or a --shards change stopped the application's
writes.  Now an outbox of CONCURRENTLY_FROM_BYTES or more gets CREATE INDEX CONCURRENTLY
(per partition, then attached, when partitioned): writers go on, the build waits for older
transactions, and gives up naming them after --index-wait-s (relay/migrate_index.py).  On PostgreSQL 15 the index built is 0001's, the same way."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import migrate, migrate_index
from relay.partitions import partition_name
from relay.queries import query
from tests.fixtures.procs import wait_until
from tests.integration.test_migrate_races import _PausingLog, _Run, _waiting_for_the_run_lock
from tests.integration.test_pending_index import PARTITION_INDEXES, Events, _the_other_index
from tests.integration.test_pgbouncer import pgbouncer  # noqa: F401 - the fixture

#: Published rows of about 1 kB: a table past CONCURRENTLY_FROM_BYTES.
FILL = """
INSERT INTO outbox (topic, key, payload, published_at)
SELECT 'orders', 'k' || (g %% 50), jsonb_build_object('pad', repeat('x', 900)), now()
FROM generate_series(1, %(rows)s) AS g
"""
CLAIM_INDEXES = """
SELECT c.relname::text, x.indisvalid
FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid
WHERE x.indrelid = 'outbox'::regclass AND c.relname LIKE 'outbox_pending%%'
ORDER BY 1
"""
#: migrate's session waiting on a lock: the plain build's table lock, or a concurrent build
#: waiting for a transaction older than it (a virtualxid lock).
MIGRATE_WAITING = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'outbox-relay-migrate'
  AND wait_event_type = 'Lock' AND wait_event <> 'advisory'
"""


def _fill(dsn: str, rows: int = 12_000) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(FILL, {"rows": rows})
        (size,) = conn.execute(query("admin", "outbox_heap_bytes")).fetchone() or (0,)
    assert size >= migrate_index.CONCURRENTLY_FROM_BYTES, size


def _claim_indexes(dsn: str) -> dict[str, bool]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute(CLAIM_INDEXES).fetchall())


def _migrate_waiting(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(MIGRATE_WAITING).fetchone()
    return bool(row and row[0])


def _open_writer(dsn: str, *, partitioned: bool = False) -> psycopg.Connection[Any]:
    """A writer in its transaction (one row inserted, not committed), named slow-writer.
    ``partitioned``: into today's partition itself, so that it holds no lock on the outbox
    (the partitioned index ON ONLY the outbox, a moment's SHARE lock on it, is built first,
    as a migration's lock is taken: writers of the outbox would queue behind it while it
    waited, at most --lock-timeout-s)."""
    writer = psycopg.connect(dsn)
    writer.execute("SET application_name = 'slow-writer'")
    table = sql.Identifier(partition_name(datetime.now(UTC).date()) if partitioned else "outbox")
    writer.execute(sql.SQL("INSERT INTO {} (id, topic, key, payload) OVERRIDING SYSTEM VALUE "  # a partition
                           "VALUES (nextval(pg_get_serial_sequence('outbox', 'id')), 'orders', 'a', '{{}}')"
                           ).format(table))  # has the outbox's identity from PostgreSQL 17 on only
    return writer


def _insert_within(dsn: str, lock_timeout: str) -> None:
    """Another writer's one-row transaction, refused if it waits longer than ``lock_timeout``."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (lock_timeout,))
        conn.execute("INSERT INTO outbox (topic, key, payload) VALUES ('orders', 'b', '{}')")


class _Migrate(threading.Thread):
    def __init__(self, dsn: str, **options: Any) -> None:
        super().__init__(daemon=True)
        self.dsn, self.options, self.log = dsn, options, Events()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            migrate.apply(self.dsn, log=self.log, **self.options)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc


def _migrate_behind_a_writer(dsn: str, waiting: Callable[[], bool], what: str,
                             meanwhile: Callable[[], None] = lambda: None, *,
                             partitioned: bool = False) -> _Migrate:
    """A migrate started while a writer's transaction is open: once ``waiting()`` (it ``what``),
    ``meanwhile()`` runs and migrate must still be at it; then the writer commits, and migrate
    must end without an error."""
    writer = _open_writer(dsn, partitioned=partitioned)
    run = _Migrate(dsn, lock_timeout_s=30)
    try:
        run.start()
        wait_until(lambda: not run.is_alive() or waiting(), 30, message=f"migrate neither {what} nor ended")
        meanwhile()
        assert run.is_alive() and run.error is None, run.error  # still waiting for the open writer
    finally:
        writer.commit()
        writer.close()
    run.join(60)
    assert not run.is_alive() and run.error is None, run.error
    return run


@pytest.mark.parametrize("partitioned", [False, True])
def test_writers_go_on_while_the_index_is_built_on_a_large_outbox(db_dsn, partitioned):
    migrate.apply(db_dsn, partitioned=partitioned)
    kept = _the_other_index(db_dsn)
    _fill(db_dsn)
    # Before: the INSERT queued behind the build's SHARE lock request for the whole of
    # migrate's lock_timeout (30 s here) and was refused at its own 3 s.
    run = _migrate_behind_a_writer(db_dsn, lambda: _migrate_waiting(db_dsn), "waited for the open writer",
                                   lambda: _insert_within(db_dsn, "3s"), partitioned=partitioned)
    assert _claim_indexes(db_dsn) == {kept: True}
    built = [f for e, f in run.log.said if e == "pending_index_built"]
    assert built and built[0]["concurrently"] is True, run.log.said
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")  # both writers' rows are in the new index
        (pending,) = conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL "
                                  "AND xid >= '0'::xid8").fetchone() or (0,)
        if partitioned:  # every partition's part attached: the partitioned index is valid
            ((mine, other),) = conn.execute(PARTITION_INDEXES, {"kept": kept}).fetchall()
            (partitions,) = conn.execute("SELECT count(*) FROM pg_inherits "
                                         "WHERE inhparent = 'outbox'::regclass").fetchone() or (0,)
            assert partitions > 0 and (mine, other) == (partitions, 0)
    assert pending == 2


def given_up_build(dsn: str, migrate_dsn: str | None = None) -> tuple[str, _Migrate]:
    """A large outbox with the other claim index than migrate keeps, and a migrate (through
    ``migrate_dsn``, ``dsn`` by default) whose concurrent build waited 2 s for a writer's
    open transaction (a warning every two thirds of a second), then gave up; the writer's transaction rolled back after.
    Returns the index migrate keeps and the run."""
    migrate.apply(dsn)
    kept = _the_other_index(dsn)
    _fill(dsn)
    writer = _open_writer(dsn)
    try:
        run = _Migrate(migrate_dsn or dsn, index_wait_s=2.0)
        run.start()
        run.join(60)
    finally:
        writer.rollback()
        writer.close()
    assert isinstance(run.error, migrate.MigrationBlocked), run.error
    assert "slow-writer" in str(run.error), run.error
    return kept, run


def test_a_build_waiting_too_long_names_the_session_and_the_next_run_finishes_it(db_dsn):
    kept, run = given_up_build(db_dsn)
    message = str(run.error)
    assert "CREATE INDEX CONCURRENTLY" in message and "never holds writers" in message, message
    waits = [f for e, f in run.log.said if e == "migration_lock_wait" and f["name"] == "pending_index"]
    # One a third of the wait (a watch held up longer than that by a busy machine logs fewer).
    assert waits and [w["attempt"] for w in waits] == list(range(1, len(waits) + 1)) and len(waits) <= 2, waits
    assert all(w["phase"].startswith("waiting") and w["waiting_for_pid"] for w in waits), waits
    assert _claim_indexes(db_dsn).get(kept) is False  # PostgreSQL's unfinished build: invalid
    migrate.apply(db_dsn)  # drops the unfinished build and builds it again
    assert _claim_indexes(db_dsn) == {kept: True}


#: migrate's concurrent build waiting for a lock (a writer's open transaction) this long.
BUILD_WAITED = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'outbox-relay-migrate'
  AND wait_event_type = 'Lock' AND wait_event <> 'advisory' AND query LIKE 'CREATE INDEX CONCURRENTLY%%'
  AND now() - query_start > make_interval(secs => %(waited_s)s)
"""


def _build_waited(dsn: str, waited_s: float) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(BUILD_WAITED, {"waited_s": waited_s}).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("setting", ["statement_timeout", "lock_timeout"])
def test_a_role_timeout_does_not_cancel_the_concurrent_build(db_dsn, setting):
    """A DBA's `ALTER ROLE ... SET statement_timeout = '50ms'` (or lock_timeout) is meant for
    the application's queries; migrate lifts both in its transactions.  Before, the concurrent
    build, outside them, ran under the role's: waiting 50 ms for a writer's open transaction
    (or a large outbox's build taking that long) cancelled it, exit 6, and it did so at every
    run.  Now the build runs on a connection of its own with both lifted at start-up, its
    waits bounded by --index-wait-s."""
    migrate.apply(db_dsn)
    kept = _the_other_index(db_dsn)
    _fill(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER ROLE current_user IN DATABASE {} SET {} = '50ms'").format(
            sql.Identifier(conn.info.dbname), sql.Identifier(setting)))
    # Before: cancelled at 50 ms, while it waited for the open writer.
    _migrate_behind_a_writer(db_dsn, lambda: _build_waited(db_dsn, 0.5), "waited past the role's 50 ms")
    assert _claim_indexes(db_dsn) == {kept: True}
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # the role's sessions keep its setting
        assert conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone() == ("50ms",)


def test_two_migrates_at_once_on_a_large_outbox_both_finish(db_dsn):
    """The second migrate waits for the first's run lock.  Had it waited in a statement (as
    before the concurrent build), which holds a snapshot, the first's concurrent build would
    wait for that snapshot: each waiting for the other until the first's watch gave up
    (MigrationBlocked naming the second).  It tries the lock again and again instead."""
    log = _PausingLog()
    first = _Run(db_dsn, partitioned=False, log=log)
    first.start()
    wait_until(lambda: log.paused.is_set() or not first.is_alive(), 60, message="first migrate never paused")
    try:
        with psycopg.connect(db_dsn, autocommit=True) as conn:  # 0001 applied: its index to build again
            conn.execute("DROP INDEX outbox_pending_idx")
        _fill(db_dsn)
        second = _Run(db_dsn, partitioned=False)
        second.start()
        wait_until(lambda: not second.is_alive() or _waiting_for_the_run_lock(db_dsn), 30,
                   message="the second migrate neither waited nor ended")
    finally:
        log.go_on.set()
    first.join(90)
    second.join(90)
    assert first.error is None and second.error is None, (first.error, second.error)
    assert second.applied == []
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        keep = migrate.claim_index(conn.info.server_version, migrate.DEFAULT_SHARDS)
    assert _claim_indexes(db_dsn) == {keep: True}


def test_through_a_transaction_pooler_the_build_gives_up_cleanly_and_a_later_run_builds_it(db_dsn, pgbouncer):  # noqa: F811
    """migrate works through a transaction pooler (README): the concurrent build runs outside
    a transaction, its watch cancels it through the pooler, and nothing of migrate's stays
    on the server connections the pooler hands the application next."""
    pooled = pgbouncer("transaction")
    kept, _ = given_up_build(db_dsn, pooled)
    run = _Migrate(pooled)
    run.start()
    run.join(60)
    assert not run.is_alive() and run.error is None, run.error
    assert _claim_indexes(db_dsn) == {kept: True}
    conns = [psycopg.connect(pooled, autocommit=True) for _ in range(4)]
    try:
        for conn in conns:
            assert conn.execute("SELECT current_setting('lock_timeout'), "
                                "current_setting('statement_timeout')").fetchone() == ("0", "0")
    finally:
        for conn in conns:
            conn.close()
