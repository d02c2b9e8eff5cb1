"""The time-partitioned outbox (issue 5): created by `migrate --partitioned`, relayed like
the plain one, and kept by dropping whole past partitions once fully published."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from relay import migrate
from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    relay_cmd,
    scalar,
    wait_drained,
)
from tests.fixtures.procs import wait_until


def partitions(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'outbox'::regclass ORDER BY 1")]


def test_relay_works_on_a_partitioned_outbox_and_cleanup_drops_old_days(db_dsn, broker, topic):
    migrate.apply(db_dsn, partitioned=True)
    assert scalar(db_dsn, "SELECT relkind FROM pg_class WHERE oid = 'outbox'::regclass") == "p"
    today = f"outbox_p{datetime.now(UTC):%Y%m%d}"
    week = f"outbox_p{datetime.now(UTC) + timedelta(days=7):%Y%m%d}"
    assert {today, week} <= set(partitions(db_dsn))  # migrate created the coming days
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {week}")  # noqa: S608 - the relay's maintenance recreates it
    insert_rows(db_dsn, topic, 3000, keys=50, per_tx=500)
    with RelayThread(db_dsn, broker.bootstrap, cleanup_interval_s=0.2) as relay:
        wait_until(lambda: week in partitions(db_dsn), timeout_s=30,
                   message="the relay did not create the coming days' partitions")
        insert_rows(db_dsn, topic, 3000, keys=50, start=3000, per_tx=500)
        wait_drained(db_dsn, timeout_s=60)
        # The counter moves on the pump's thread just after the mark commits: wait for it.
        wait_until(lambda: relay.metrics.registry.get_sample_value(
            "outbox_relay_events_published_total", {"topic": topic}) == 6000,
            timeout_s=10, message="outbox_relay_events_published_total")
    assert scalar(db_dsn, f"SELECT count(*) FROM {today}") == 6000  # noqa: S608
    assert scalar(db_dsn, "SELECT count(*) FROM outbox_default") == 0
    expected = all_event_ids(db_dsn)
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert delivery.missing == set() and delivery.order_violations == []

    # Two past days: one fully published, one with a pending row.  Retention of 1 hour.
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for days in (3, 2):
            day = (datetime.now(UTC) - timedelta(days=days)).date()
            conn.execute(f"CREATE TABLE outbox_p{day:%Y%m%d} PARTITION OF outbox FOR VALUES "  # noqa: S608
                         f"FROM ('{day}') TO ('{day + timedelta(days=1)}')")
            conn.execute("INSERT INTO outbox (topic, key, payload, created_at, published_at) "
                         "VALUES ('old', 'k', '{}', %s, %s)",
                         (datetime.combine(day, datetime.min.time(), tzinfo=UTC),) * 2)
        old_pending = (datetime.now(UTC) - timedelta(days=2)).date()
        conn.execute("UPDATE outbox SET published_at = NULL WHERE created_at::date = %s", (old_pending,))
        # A published row of a day without a partition, in outbox_default: `cleanup` left such
        # rows for ever, only run's own cleanup deleted them (an audit of the relay's operation).
        stray = datetime.now(UTC) - timedelta(days=30)
        conn.execute("INSERT INTO outbox (topic, key, payload, created_at, published_at) "
                     "VALUES ('old', 'k', '{}', %s, %s)", (stray, stray))
    assert scalar(db_dsn, "SELECT count(*) FROM outbox_default") == 1
    out = subprocess.run(relay_cmd("cleanup", "--dsn", db_dsn, "--cleanup-retention-s", "3600"),
                         capture_output=True, text=True, check=True)
    assert scalar(db_dsn, "SELECT count(*) FROM outbox_default") == 0, out.stdout
    assert "deleted 1 published rows" in out.stdout, out.stdout
    three_days_ago = (datetime.now(UTC) - timedelta(days=3)).date()
    assert f"dropped: outbox_p{three_days_ago:%Y%m%d}" in out.stdout
    assert f"kept (rows pending): outbox_p{old_pending:%Y%m%d}" in out.stdout
    left = partitions(db_dsn)
    assert f"outbox_p{three_days_ago:%Y%m%d}" not in left and f"outbox_p{old_pending:%Y%m%d}" in left
    assert today in left


def test_a_retention_under_a_day_does_not_make_and_drop_yesterday_at_every_run(db_dsn):
    """Maintenance made the partitions from yesterday on, and dropped the past ones older
    than the retention: with a retention under a day, yesterday's partition was made at one
    run and dropped at the next, again and again, each time under a lock on the whole
    outbox.  Now a day already past its retention is not made."""
    from relay.partitions import maintain, partition_name

    migrate.apply(db_dsn, partitioned=True)
    noon = datetime.combine(datetime.now(UTC).date(), datetime.min.time(), tzinfo=UTC) + timedelta(hours=12)
    yesterday = partition_name((noon - timedelta(days=1)).date())
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        first = maintain(conn, retention_s=3600, now=noon)  # drops yesterday if migrate made it
        runs = [maintain(conn, retention_s=3600, now=noon) for _ in range(3)]
        assert [(r.created, r.dropped) for r in runs] == [([], [])] * 3, (first, runs)
        assert yesterday not in partitions(db_dsn)
        # A retention of a week keeps yesterday: it is made and stays.
        week = [maintain(conn, retention_s=7 * 86400, now=noon) for _ in range(2)]
        assert week[0].created == [yesterday] and (week[1].created, week[1].dropped) == ([], [])


def test_two_maintainers_racing_for_the_same_partitions_both_come_through(db_dsn):
    """Two maintainers (replicas' cleanups, the daily `cleanup`, a second `migrate
    --partitioned`) creating the same days: CREATE ... IF NOT EXISTS raced and raised
    DuplicateTable, 39 times in 40 in an audit of the relay's operation, and that ended the
    relay's cleanup thread for good.  Each gets the days made, by itself or the other."""
    import threading

    from relay.partitions import maintain

    migrate.apply(db_dsn, partitioned=True)
    base = datetime.combine(datetime.now(UTC).date(), datetime.min.time(), tzinfo=UTC) + timedelta(days=30)
    errors: list[BaseException] = []

    def run(day: int, start: threading.Barrier) -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True) as conn:
                start.wait(10)
                maintain(conn, retention_s=None, now=base + timedelta(days=day * 10))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    for day in range(10):  # ten fresh ranges of days, two maintainers on each
        start = threading.Barrier(2)
        threads = [threading.Thread(target=run, args=(day, start)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert errors == []
    assert len(partitions(db_dsn)) >= 10 * 8


def test_rows_sharing_an_id_across_partitions_are_each_sent(db_dsn, broker, topic):
    """PostgreSQL keeps (id, created_at) unique on a partitioned outbox, not id: a back-fill
    with OVERRIDING SYSTEM VALUE (or a switchover that left the sequence behind) gives two
    rows one id.  Marks matched by id alone: publishing the first marked the second, which
    was never sent (an audit of the relay's operation lost 1,240 rows).  Marks on a
    partitioned outbox match the event id too."""
    migrate.apply(db_dsn, partitioned=True)
    yesterday = datetime.now(UTC) - timedelta(days=1)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (id, topic, key, payload, created_at) OVERRIDING SYSTEM VALUE "
                     "SELECT g, %s, 'k' || (g %% 50), jsonb_build_object('key', 'k' || (g %% 50), 'seq', g / 50), %s "
                     "FROM generate_series(1, 2000) AS g", (topic, yesterday))
    insert_rows(db_dsn, topic, 2000, keys=50, start=2000)  # ids 1..2000 again, from the identity
    assert scalar(db_dsn, "SELECT count(DISTINCT id) FROM outbox") == 2000
    expected = all_event_ids(db_dsn)
    assert len(expected) == 4000
    # One small batch at a time: a twin is still pending, unclaimed, when the other is marked.
    with RelayThread(db_dsn, broker.bootstrap, batch_size=100, pipeline_depth=1):
        wait_drained(db_dsn, timeout_s=60)
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert delivery.missing == set(), f"{len(delivery.missing)} rows marked published, never sent"


def test_partitioned_is_refused_on_an_existing_plain_outbox(outbox_db):
    result = subprocess.run(relay_cmd("migrate", "--dsn", outbox_db, "--partitioned"),
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "already exists as a plain table" in result.stderr


def test_an_event_id_written_twice_in_a_transaction_is_a_duplicate_event(db_dsn):
    """On the partitioned outbox event_id is unique with created_at (the transaction's
    time), and a partition's index refuses the row: it is a DuplicateEvent there too, not
    psycopg's UniqueViolation."""
    from consumer_sdk import DuplicateEvent, write_event

    migrate.apply(db_dsn, partitioned=True)
    with psycopg.connect(db_dsn) as conn:
        event_id = write_event(conn, topic="orders", key="k", payload={})
        with pytest.raises(DuplicateEvent, match=f"{event_id}.*written once"):
            write_event(conn, topic="orders", key="k", payload={}, event_id=event_id)
        conn.rollback()
