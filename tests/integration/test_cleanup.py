"""Retention (issue 5): cleanup under a running relay loses nothing and never touches
pending rows."""

from __future__ import annotations

import subprocess
import threading

import psycopg

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    pending,
    relay_cmd,
    scalar,
    wait_drained,
)
from tests.fixtures.procs import wait_until


def test_cleanup_command_never_touches_pending_rows(outbox_db):
    insert_rows(outbox_db, "orders", 500, keys=10)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET published_at = now() - interval '1 hour' WHERE id <= 200")
    out = subprocess.run(relay_cmd("cleanup", "--dsn", outbox_db, "--cleanup-retention-s", "60",
                                   "--cleanup-batch", "50"), capture_output=True, text=True, check=True)
    assert "deleted 200 published rows" in out.stdout
    assert pending(outbox_db) == 300
    assert scalar(outbox_db, "SELECT count(*) FROM outbox") == 300


WRITER_ROWS_MAX = 8000


def test_built_in_cleanup_under_a_running_relay_loses_nothing(outbox_db, broker, topic):
    stop = threading.Event()
    written = [0]

    def write() -> None:
        # Bounded: the cleanup deletes at most 50 rows every 0.1 s whatever the machine, and
        # an unbounded writer on a fast one could outrun the "fewer than half" wait below.
        while not stop.is_set() and written[0] < WRITER_ROWS_MAX:
            insert_rows(outbox_db, topic, 100, keys=20, start=written[0])
            written[0] += 100
            stop.wait(0.01)

    writer = threading.Thread(target=write, daemon=True)
    with RelayThread(outbox_db, broker.bootstrap, batch_size=100, cleanup_retention_s=0.2,
                     cleanup_interval_s=0.1, cleanup_batch=50) as relay:
        writer.start()
        try:
            wait_until(lambda: (relay.metrics.registry.get_sample_value(
                "outbox_relay_cleanup_deleted_rows_total") or 0) >= 3000, timeout_s=60,
                message="cleanup did not delete rows while the relay ran")
        finally:
            stop.set()
            writer.join()
        wait_drained(outbox_db, timeout_s=60)
        remaining = all_event_ids(outbox_db)
        wait_until(lambda: scalar(outbox_db, "SELECT count(*) FROM outbox") < written[0] // 2,
                   timeout_s=30)
    records = read_all(broker.bootstrap, topic, expected=written[0], timeout_s=60)
    delivered = {r.headers["event_id"].decode() for r in records}
    assert len(delivered) == written[0]  # every written row reached Kafka, deleted or not
    assert remaining <= delivered
    delivery = check_delivery(records, delivered)
    assert delivery.order_violations == []


def test_a_round_skips_what_it_deleted_and_the_next_round_finds_late_commits(outbox_db):
    from relay.janitor import Janitor
    from relay.store import Store

    insert_rows(outbox_db, "orders", 300, keys=10)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        # Published one second apart, oldest first; rows 251.. stay pending.
        conn.execute("UPDATE outbox SET published_at = now() - interval '1 hour' + id * interval '1 s'"
                     " WHERE id <= 250")
    store = Store(outbox_db)
    try:
        janitor = Janitor(store, retention_s=60, batch=40, interval_s=0, max_batches=1000)
        seen: list[object] = []
        real = store.cleanup_batch

        def spy(**kw):  # records the lower bound each batch of the round starts from
            seen.append(kw["after"])
            return real(**kw)

        store.cleanup_batch = spy  # type: ignore[method-assign]
        assert janitor.run_once() == 250
        assert seen[0] is None and all(b is not None for b in seen[1:]) and len(seen) == 7
        assert seen == sorted(seen, key=lambda b: (b is not None, b))
        # A mark whose transaction began an hour ago commits only now: its published_at
        # lies before everything this round passed; the next round starts from the start.
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("UPDATE outbox SET published_at = now() - interval '2 hours' WHERE id = 251")
        assert janitor.run_once() == 1
    finally:
        store.close()
    assert pending(outbox_db) == 49
    assert scalar(outbox_db, "SELECT count(*) FROM outbox") == 49
