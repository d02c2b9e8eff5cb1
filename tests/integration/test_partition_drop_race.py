"""Issue 15, item 6: dropping a past day's partition cannot drop a row committed into it
while the maintenance runs.

The partition is fully published, so the "no pending rows" check passes; a writer's
transaction has inserted an unpublished row into it and commits exactly while the
maintenance waits for its DETACH lock.  Every row written must then be in the table
or published."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import psycopg

from relay import migrate
from relay.partitions import PartitionReport, maintain, partition_name
from tests.fixtures.outbox import scalar
from tests.fixtures.procs import wait_until

RETENTION_S = 3600.0


def _old_day() -> tuple[str, datetime]:
    day = (datetime.now(UTC) - timedelta(days=3)).date()
    return partition_name(day), datetime.combine(day, datetime.min.time(), tzinfo=UTC)


def _make_published_partition(dsn: str) -> tuple[str, datetime]:
    name, start = _old_day()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} PARTITION OF outbox FOR VALUES "  # noqa: S608
                     "FROM (%s) TO (%s)".replace("%s", "'{}'").format(start, start + timedelta(days=1)))
        conn.execute("INSERT INTO outbox (topic, key, payload, created_at, published_at) "
                     "SELECT 'old', 'k' || g, '{}', %s, %s FROM generate_series(1, 100) AS g",
                     (start, start))
    return name, start


def _maintenance_waits_for_a_lock(dsn: str) -> bool:
    return bool(scalar(dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                            "AND application_name = 'partition-maintenance' AND wait_event_type = 'Lock'"))


def _run_maintenance(dsn: str, reports: list[PartitionReport]) -> threading.Thread:
    def run() -> None:
        with psycopg.connect(dsn, autocommit=True, application_name="partition-maintenance") as conn:
            reports.append(maintain(conn, retention_s=RETENTION_S))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_row_committed_while_the_drop_waits_for_its_lock_is_kept(db_dsn):
    migrate.apply(db_dsn, partitioned=True)
    name, start = _make_published_partition(db_dsn)
    writer = psycopg.connect(db_dsn)  # a transaction in flight, as a service writes
    try:
        writer.execute("INSERT INTO outbox (topic, key, payload, created_at) "
                       "VALUES ('late', 'k-late', '{}', %s)", (start + timedelta(hours=1),))
        reports: list[PartitionReport] = []
        maintenance = _run_maintenance(db_dsn, reports)
        wait_until(lambda: _maintenance_waits_for_a_lock(db_dsn), timeout_s=10,
                   message="the maintenance never waited for the writer's lock")
        writer.commit()  # within the lock timeout: the maintenance goes on
    finally:
        writer.close()
    maintenance.join(30)
    assert reports, "the maintenance did not finish"
    assert name in reports[0].kept_pending, reports[0]
    assert name not in reports[0].dropped
    assert scalar(db_dsn, "SELECT count(*) FROM outbox WHERE topic = 'late' AND published_at IS NULL") == 1


def test_writers_committing_into_the_dropped_partition_lose_nothing(db_dsn):
    """Four writers keep committing rows into the old day, mostly published ones (which
    may go with the partition) and every tenth unpublished, while the maintenance runs
    again and again: every unpublished row written is still in the outbox afterwards
    (in its partition, or in outbox_default once the partition is gone)."""
    migrate.apply(db_dsn, partitioned=True)
    name, start = _make_published_partition(db_dsn)
    stop = threading.Event()
    unpublished: list[int] = []
    lock = threading.Lock()

    def write(n: int) -> None:
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            i = 0
            while not stop.is_set():
                i += 1
                with conn.transaction():
                    row = conn.execute(
                        "INSERT INTO outbox (topic, key, payload, created_at, published_at) "
                        "VALUES ('late', %s, '{}', %s, %s) RETURNING id, published_at",
                        (f"w{n}-{i}", start + timedelta(minutes=i % 1000),
                         None if i % 10 == 0 else start)).fetchone()
                    # Commit a little later, as a service's transaction does.
                    conn.execute("SELECT pg_sleep(0.02)")
                assert row is not None
                if row[1] is None:
                    with lock:
                        unpublished.append(int(row[0]))

    writers = [threading.Thread(target=write, args=(n,), daemon=True) for n in range(4)]
    for w in writers:
        w.start()
    try:
        wait_until(lambda: len(unpublished) >= 1, timeout_s=10, message="writers did not write")
        for _ in range(20):
            reports: list[PartitionReport] = []
            _run_maintenance(db_dsn, reports).join(30)
            assert reports, "the maintenance did not finish"
    finally:
        stop.set()
        for w in writers:
            w.join(10)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        kept = {r[0] for r in conn.execute("SELECT id FROM outbox WHERE published_at IS NULL")}
    lost = set(unpublished) - kept
    assert not lost, f"{len(lost)} of {len(unpublished)} unpublished rows were dropped with {name}"
