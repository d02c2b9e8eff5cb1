"""No transaction holds back events it did not write (issue 14).

Claims batch by snapshot difference, so a transaction left open (a session idle in
transaction, a long batch job, a prepared transaction here or in another database)
delays nothing but its own rows.  Measured from the database: commit to mark is
``published_at - created_at`` of one-row autocommit writes (``created_at`` is the
transaction's start, a few hundred microseconds before its commit).
"""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
from psycopg import sql

from tests.fixtures.apache_kafka import ApacheKafkaBroker
from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    needs_prepared_transactions,
    wait_drained,
)
from tests.fixtures.procs import wait_until

BASELINE_S = 10.0
HOLD_S = 60.0  # the figure: one minute of each hazard held open
RATE_PER_S = 200


def write_steadily(dsn: str, topic: str, seconds: float, label: str, errors: list[BaseException]) -> None:
    """One-row autocommit transactions at RATE_PER_S for ``seconds``."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            started = time.monotonic()
            n = 0
            while (elapsed := time.monotonic() - started) < seconds:
                conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, %s, %s)",
                             (topic, f"k{n % 50}", f'{{"label": "{label}", "n": {n}}}'))
                n += 1
                ahead = n / RATE_PER_S - elapsed
                if ahead > 0:
                    time.sleep(ahead)  # noqa: TID251 - pacing the writer, not waiting on the relay
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)


def latencies_ms(dsn: str, label: str) -> list[float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sorted(float(r[0]) for r in conn.execute(
            "SELECT extract(epoch FROM published_at - created_at) * 1000 FROM outbox "
            "WHERE payload->>'label' = %s AND published_at IS NOT NULL", (label,)))


def count(dsn: str, label: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute("SELECT count(*) FROM outbox WHERE payload->>'label' = %s",
                                (label,)).fetchone()[0])


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def mark_mean_ms(relay: RelayThread) -> tuple[float, float]:
    r = relay.metrics.registry
    total = r.get_sample_value("outbox_relay_mark_duration_seconds_sum") or 0.0
    count = r.get_sample_value("outbox_relay_mark_duration_seconds_count") or 0.0
    return total, count


def test_open_and_prepared_transactions_hold_back_only_their_own_rows(
        outbox_db, pg_server, broker, topic, request):
    needs_prepared_transactions(outbox_db)
    other = f"t_other_{uuid.uuid4().hex[:10]}"
    other_dsn = pg_server.create_database(other)
    errors: list[BaseException] = []
    gids = [f"held-here-{uuid.uuid4().hex[:8]}", f"held-other-{uuid.uuid4().hex[:8]}"]
    try:
        with RelayThread(outbox_db, broker.bootstrap, poll_interval_s=0.5) as relay:
            write_steadily(outbox_db, topic, BASELINE_S, "baseline", errors)
            wait_drained(outbox_db, timeout_s=30)
            base_sum, base_count = mark_mean_ms(relay)

            # The hazards, all at once for HOLD_S.
            idle = psycopg.connect(outbox_db)           # idle in transaction after one write
            idle.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k1', "
                         "'{\"label\": \"idle\"}')", (topic,))
            doomed = psycopg.connect(outbox_db)         # rolls back in the end
            doomed.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k2', "
                           "'{\"label\": \"doomed\"}')", (topic,))
            for gid, dsn in zip(gids, (outbox_db, other_dsn), strict=True):
                prepared = psycopg.connect(dsn)
                if dsn == outbox_db:
                    # Without it the wake-up trigger's NOTIFY (an idle relay sleeps) makes
                    # PREPARE fail: migration 0014, test_wakeup's two-phase test.
                    prepared.execute("SET LOCAL outbox.notify = 'off'")
                    prepared.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k3', "
                                     "'{\"label\": \"prepared\"}')", (topic,))
                else:
                    prepared.execute("CREATE TABLE t (x int)")
                prepared.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))  # outlives its session
                prepared.close()
            batch_stop = threading.Event()

            def long_batch() -> None:
                try:
                    with psycopg.connect(outbox_db) as conn:
                        while not batch_stop.is_set():
                            conn.execute("INSERT INTO outbox (topic, key, payload) VALUES "
                                         "(%s, 'k4', '{\"label\": \"batch\"}')", (topic,))
                            batch_stop.wait(0.1)
                        conn.commit()
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            batch = threading.Thread(target=long_batch)
            batch.start()
            write_steadily(outbox_db, topic, HOLD_S, "held", errors)
            wait_until(lambda: len(latencies_ms(outbox_db, "held")) == count(outbox_db, "held"),
                       timeout_s=30, message="the rows written while others were held")
            held = latencies_ms(outbox_db, "held")
            held_sum, held_count = mark_mean_ms(relay)
            # Nothing of the held transactions went out meanwhile.
            with psycopg.connect(outbox_db, autocommit=True) as conn:
                assert conn.execute("SELECT count(*) FROM outbox WHERE payload->>'label' IN "
                                    "('idle', 'doomed', 'prepared', 'batch')").fetchone()[0] == 0
            batch_stop.set()
            batch.join()
            idle.commit()
            idle.close()
            doomed.rollback()
            doomed.close()
            with psycopg.connect(outbox_db, autocommit=True) as conn:
                conn.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gids[0])))
            with psycopg.connect(other_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gids[1])))
            gids.clear()
            wait_drained(outbox_db, timeout_s=30)
        assert errors == []
        base = latencies_ms(outbox_db, "baseline")
        p99_base, p99_held = pct(base, 0.99), pct(held, 0.99)
        mark_base = base_sum / max(base_count, 1) * 1000
        mark_held = (held_sum - base_sum) / max(held_count - base_count, 1) * 1000
        print(f"commit->mark without held transactions: p50 {pct(base, 0.5):.1f} ms, "
              f"p99 {p99_base:.1f} ms; with them: p50 {pct(held, 0.5):.1f} ms, p95 {pct(held, 0.95):.1f} ms, "
              f"p99 {p99_held:.1f} ms, max {held[-1]:.1f} ms; "
              f"mean mark {mark_base:.2f} ms -> {mark_held:.2f} ms")
        # The target (p99 under 100 ms, within 3x) is the bench's stalled_writer figure, on
        # a quiet machine.  Here the test shares two cores with the whole suite, so it holds
        # the relay to the shape that tells the two claims apart: the old horizon claim held
        # every row of the minute until the transactions ended (p50 about 30 s, none under
        # a second), and each bound below fails on it.  The tail is not asserted: under the
        # suite's load it reached seconds on both brokers (2026-12-01, fresh-clone CI runs:
        # tansu p95 1.9 s / max 2.5 s with p50 14 ms; Apache Kafka p99 3.5 s; alone, or
        # beside three CPU hogs, p99 22-64 ms), which is noise this test cannot tell from a
        # regression; the bench's stalled_writer run measures it.
        p50_base, p50_held = pct(base, 0.5), pct(held, 0.5)
        assert p50_held < 1000.0
        assert held[-1] < 50_000.0  # the old claim: the first rows of the minute waited 60 s
        if not isinstance(broker, ApacheKafkaBroker):
            assert p50_held <= 3 * max(p50_base, 20.0)
        expected = all_event_ids(outbox_db)
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            labels = dict(conn.execute("SELECT payload->>'label', count(*) FROM outbox "
                                       "GROUP BY 1").fetchall())
        assert labels.get("doomed") is None
        assert labels["idle"] == 1 and labels["prepared"] == 1 and labels["batch"] >= HOLD_S * 5
        received = {r.headers["event_id"].decode() for r in
                    read_all(broker.bootstrap, topic, expected=expected, timeout_s=60)}
        assert received == expected
    finally:
        for dsn in (outbox_db, other_dsn):
            with psycopg.connect(dsn, autocommit=True) as conn:
                for (left,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = "
                                            "current_database()").fetchall():
                    conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(left)))
        pg_server.drop_database(other)
