"""The wake-up adapter (relay/wakeup.py) on a real PostgreSQL: writers notify only while a
relay sleeps (holds the wake-up lock), one relay sleeps at a time, and the lock goes
with the connection (sql/migrations/0003_notify.sql)."""

from __future__ import annotations

import time
import uuid

import pytest

from relay.wakeup import Wakeup
from tests.fixtures.outbox import insert_rows, needs_prepared_transactions
from tests.fixtures.procs import wait_until


def test_a_sleeping_relay_is_woken_by_a_commit_and_an_awake_one_costs_writers_nothing(outbox_db):
    wakeup = Wakeup(outbox_db)
    try:
        assert not wakeup.wait(0.05)  # listening now; nothing written
        insert_rows(outbox_db, "orders", 3)  # awake: the trigger's lock probe succeeds, no NOTIFY
        assert not wakeup.wait(0.3)
        assert wakeup.set_sleeping(True) and wakeup.sleeping
        started = time.monotonic()
        insert_rows(outbox_db, "orders", 3)
        assert wakeup.wait(10.0)
        assert time.monotonic() - started < 5.0  # woken by the commit, not by the timeout
        assert not wakeup.set_sleeping(False) and not wakeup.sleeping
        insert_rows(outbox_db, "orders", 1)
        assert not wakeup.wait(0.3)
        assert wakeup.queries >= 3  # LISTEN, sleep, wake: counted for the idle-cost figures
    finally:
        wakeup.close()


def test_one_relay_sleeps_at_a_time_and_the_lock_goes_with_its_connection(outbox_db):
    first, second = Wakeup(outbox_db), Wakeup(outbox_db)
    try:
        assert first.set_sleeping(True) and not first.peer_sleeps
        assert not second.set_sleeping(True)  # a peer sleeps: writers notify everyone anyway
        assert second.peer_sleeps  # found in pg_locks: the loop waits for a notification
        insert_rows(outbox_db, "orders", 1)
        assert second.wait(10.0)  # it listens too, so it is woken as well
        first.close()
        first.close()  # idempotent
        assert not first.sleeping
        # The lock goes with first's connection: its server process ends when it reads the
        # close, a moment after the client's close() returns (PostgreSQL 15 in CI, 2026-12-01).
        wait_until(lambda: second.set_sleeping(True), timeout_s=10,
                   message="the wake-up lock after its connection closed")
    finally:
        first.close()
        second.close()


def test_a_writer_mid_transaction_refuses_the_lock_and_is_not_a_sleeping_peer(outbox_db):
    import psycopg

    wakeup = Wakeup(outbox_db)
    try:
        with psycopg.connect(outbox_db) as writer:  # its INSERT holds the shared lock until commit
            writer.execute("INSERT INTO outbox (topic, key, payload) VALUES ('orders', 'k', '{}')")
            assert not wakeup.set_sleeping(True)
            assert not wakeup.peer_sleeps  # nobody notifies: the loop claims again at its pace
            writer.commit()
        assert wakeup.set_sleeping(True) and not wakeup.peer_sleeps
    finally:
        wakeup.close()


def test_a_two_phase_writer_prepares_beside_a_sleeping_relay_with_outbox_notify_off(outbox_db):
    """PostgreSQL refuses to PREPARE a transaction that ran NOTIFY, and the wake-up trigger
    notifies while a relay sleeps.  With outbox.notify off in its transaction a writer can
    prepare (migration 0014); the relay finds the row at its poll, not by a notification."""
    import psycopg
    from psycopg import sql

    needs_prepared_transactions(outbox_db)
    wakeup = Wakeup(outbox_db)
    gid = f"two-phase-{uuid.uuid4().hex[:8]}"
    try:
        assert not wakeup.wait(0.05)  # listening
        assert wakeup.set_sleeping(True)
        with psycopg.connect(outbox_db) as writer:  # as 0003 alone: PREPARE refused
            writer.execute("INSERT INTO outbox (topic, key, payload) VALUES ('orders', 'k', '{}')")
            with pytest.raises(psycopg.errors.FeatureNotSupported, match="NOTIFY"):
                writer.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        with psycopg.connect(outbox_db) as writer:
            writer.execute("SET LOCAL outbox.notify = 'off'")
            writer.execute("INSERT INTO outbox (topic, key, payload) VALUES ('orders', 'k', '{}')")
            writer.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
            gid = ""
            assert conn.execute("SELECT count(*) FROM outbox").fetchone()[0] == 1  # type: ignore[index]
        assert not wakeup.wait(0.3)  # nothing notified: the poll finds the row
    finally:
        if gid:
            with psycopg.connect(outbox_db, autocommit=True) as conn:
                if conn.execute("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s", (gid,)).fetchone():
                    conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        wakeup.close()


def test_a_peers_notice_about_shards_is_read_without_waiting_and_ends_a_wait(outbox_db):
    from relay.store import Store

    store = Store(outbox_db, application_name="outbox-relay:a")
    a, b = Wakeup(outbox_db, owner="a"), Wakeup(outbox_db, owner="b")
    try:
        assert not a.shards_moved() and not b.shards_moved()  # both listening now
        store.notify_shards(owner="a")
        wait_until(lambda: b.shards_moved(), timeout_s=10, message="b never saw a's notice")
        assert not b.shards_moved()  # taken once
        assert not a.shards_moved()  # its own notice is not news
        # A notice ends a wait early without counting as a wake-up (no claim is due for it).
        store.notify_shards(owner="a")
        started = time.monotonic()
        assert not b.wait(10.0)
        assert time.monotonic() - started < 5.0
        assert b.moved and b.shards_moved()
        # A writer's wake-up read while looking for notices is kept for the next wait.
        assert b.set_sleeping(True)
        insert_rows(outbox_db, "orders", 1)
        wait_until(lambda: b.shards_moved() or b._woken, timeout_s=10, message="no wake-up read")
        assert b.wait(0.0)
    finally:
        a.close()
        b.close()
        store.close()


def test_a_listening_connection_that_cannot_be_opened_is_tried_again_after_a_back_off(monkeypatch):
    # The loop looks for peers' notices every 0.1 s (relay/app.py).  A LISTEN connection
    # that cannot be opened (a database at its connection limit, a port refusing) must not
    # be asked for at every look: each attempt is a connection the server must refuse, and
    # the loop's thread waits on it.
    from outbox_embedded.procs import free_port
    from relay import wakeup as wakeup_module

    attempts: list[float] = []
    real_connect = wakeup_module.connect

    def counting_connect(*args, **kwargs):
        attempts.append(now[0])
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(wakeup_module, "connect", counting_connect)
    now = [1000.0]
    wakeup = Wakeup(f"postgresql://relay@127.0.0.1:{free_port()}/outbox", clock=lambda: now[0])
    for _ in range(600):  # one minute of looks, 0.1 s apart, on a port nobody listens on
        assert wakeup.shards_moved() is False
        now[0] += 0.1
    gaps = [round(b - a, 1) for a, b in zip(attempts, attempts[1:], strict=False)]
    assert 4 <= len(attempts) <= 8, attempts  # 1, 2, 4, 8, 16, 30 s apart: not 600
    assert gaps == sorted(gaps) and gaps[0] >= 1.0 and max(gaps) <= 30.0, gaps


def _terminate_listener(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        killed = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'outbox-relay-listen' AND datname = current_database()"
        ).fetchone()
    assert killed == (1,)


def test_a_listening_connection_that_broke_is_not_the_database_being_down(outbox_db):
    """The LISTEN connection idles while the relay is awake: a server's
    idle_session_timeout, a pooler or a firewall can end it while the database is fine.
    Going to sleep on it raised DatabaseUnavailable, so the relay logged the database
    down and backed off, publishing nothing meanwhile.  Now going to sleep opens a fresh
    connection and sleeps there; waking on a broken one only drops it (its lock went with
    it)."""
    wakeup = Wakeup(outbox_db)
    try:
        assert not wakeup.wait(0.05)  # listening now
        _terminate_listener(outbox_db)
        assert wakeup.set_sleeping(True) and wakeup.sleeping  # on a fresh connection
        started = time.monotonic()
        insert_rows(outbox_db, "orders", 1)
        assert wakeup.wait(10.0)  # the new connection is the one woken
        assert time.monotonic() - started < 5.0
        _terminate_listener(outbox_db)
        assert not wakeup.set_sleeping(False) and not wakeup.sleeping
        assert wakeup.set_sleeping(True)  # and it can sleep again
    finally:
        wakeup.close()


def test_a_fresh_listening_connection_that_fails_is_the_database_being_down() -> None:
    """Only a connection that broke while idle is retried: when a fresh one cannot be
    opened, going to sleep raises the relay's database error, as the claims would."""
    import pytest

    from relay.errors import DatabaseUnavailable
    from tests.fixtures.procs import free_port

    wakeup = Wakeup(f"postgresql://nobody@127.0.0.1:{free_port()}/none?connect_timeout=2")
    try:
        with pytest.raises(DatabaseUnavailable):
            wakeup.set_sleeping(True)
        assert not wakeup.sleeping
        assert not wakeup.set_sleeping(False)  # nothing to release
    finally:
        wakeup.close()
