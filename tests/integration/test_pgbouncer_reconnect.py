"""A connection the relay re-opens at run time behind a session pooler with no server free.

At start, each of the relay's connections is opened within a bound, and one the pool has
no server for is named (`database_connection_waiting`, relay/connections.py).  After the
database went away (a restart, a failover; here its server sessions ended), the loop
re-opened its connections without that check: one queued in the pooler held the loop at
its first statement, without a word, until liveness failed.  Now the loop's connections
are checked again as they are re-opened, with the start's message.  Real PgBouncer in
front of the test PostgreSQL; without it the test skips (fails in CI, which installs it)."""

from __future__ import annotations

import json
import select
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    all_event_ids,
    check_delivery,
    insert_rows,
    pending,
    relay_cmd,
    relay_env,
    wait_drained,
)
from tests.fixtures.procs import wait_until
from tests.integration.test_pgbouncer import pgbouncer  # noqa: F401 - the fixture

#: The relay's connections with one mark connection: claims, LISTEN, marks, replays.
NEEDED = 4
#: The mark connection's and the LISTEN connection's names, of the relay ``--owner remark``.
MARK, LISTEN = "outbox-relay:remark:mark", "outbox-relay-listen"


@contextmanager
def _every_server_taken(pooled: str) -> Iterator[list[threading.Thread]]:
    """NEEDED other clients, each queued for a server of the pool and holding it once it has
    one, until the block ends."""
    release = threading.Event()

    def hold() -> None:
        with psycopg.connect(pooled, autocommit=True) as conn:
            conn.execute("SELECT 1")
            release.wait(120)

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(NEEDED)]
    for thread in threads:
        thread.start()
    try:
        yield threads
    finally:
        release.set()
        for thread in threads:
            thread.join(30)


@contextmanager
def _other_clients(pooled: str, count: int) -> Iterator[list[tuple[threading.Event, threading.Event]]]:
    """``count`` other clients, each queued for a server of the pool (each has sent its first
    query when the block begins) and holding it once it has one, until the block ends or its
    release is set: (served, release) of each."""
    clients = [(threading.Event(), threading.Event()) for _ in range(count)]
    sent = [threading.Event() for _ in range(count)]

    def hold(index: int) -> None:
        served, release = clients[index]
        with psycopg.connect(pooled, autocommit=True) as conn:
            sent[index].set()
            conn.execute("SELECT 1")
            served.set()
            release.wait(120)

    threads = [threading.Thread(target=hold, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    try:
        assert all(each.wait(30) for each in sent), "the other clients could not connect to the pooler"
        yield clients
    finally:
        for _served, release in clients:
            release.set()
        for thread in threads:
            thread.join(30)


def _named(log_text: str, event: str, connection: str) -> bool:
    return any(each["connection"] == connection for each in _events(log_text, event))


def _events(log_text: str, name: str) -> list[dict[str, object]]:
    found = []
    for line in log_text.splitlines():
        if f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                found.append(dict(event))
    return found


def _tail(log_text: str) -> list[str]:
    """The events of the log's last lines, for a failure's message."""
    return [str(json.loads(line).get("event")) for line in log_text.splitlines()[-15:] if line.startswith("{")]


def _end_session(dsn: str, application_name: str) -> int:
    """End the server session of one of the relay's connections, directly on PostgreSQL."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return len(conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = %s", (application_name,)).fetchall())


def _end_relay_sessions(dsn: str, owner: str) -> int:
    """End the relay's server sessions (as a database restart does), directly on PostgreSQL."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return len(conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
            "AND (application_name LIKE %s OR application_name = 'outbox-relay-listen')",
            (f"outbox-relay:{owner}%",)).fetchall())


def _started_relay(spawn: Any, pooled: str, broker: Any, owner: str, **env: Any) -> Any:
    """The relay ``owner`` through the pooler, with one mark connection, once it started."""
    relay = spawn(relay_cmd("run"), env=relay_env(pooled, broker.bootstrap, owner=owner, mark_connections=1, **env),
                  name="relay")
    relay.wait_for_log("relay_started", timeout_s=60)
    return relay


def _stop_cleanly(relay: Any) -> None:
    relay.sigterm()
    assert relay.wait(30) == 0
    assert "Traceback" not in relay.log_text()


def _delivered_in_order(outbox_db: str, broker: Any, topic: str) -> None:
    """Every row of the outbox is on the topic, none missing, each key's in order."""
    expected = all_event_ids(outbox_db)
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert not delivery.missing and not delivery.order_violations, delivery


def test_a_connection_reopened_with_no_server_free_is_named_as_at_start(
        outbox_db, pgbouncer, broker, topic, spawn):  # noqa: F811 - the imported fixture
    pooled = pgbouncer("session", pool_size=NEEDED)
    relay = _started_relay(spawn, pooled, broker, "reopen")
    insert_rows(outbox_db, topic, 20, keys=4)
    wait_drained(outbox_db, timeout_s=60)
    since = relay.log_size()
    with _every_server_taken(pooled):
        assert _end_relay_sessions(outbox_db, "reopen") == NEEDED
        insert_rows(outbox_db, topic, 20, keys=4, start=20)
        # Which of the loop's connections re-opens first (the claims' after a failed statement,
        # or LISTEN's, which re-opens itself) is a race: either is named.
        relay.wait_for_log("database_connection_waiting", timeout_s=40, since=since)
        waiting = _events(relay.log_text(), "database_connection_waiting")[-1]
        assert waiting["level"] == "warning" and waiting["needed"] == NEEDED, waiting
        assert waiting["reopened"] is True and waiting["connection"] in {
            "outbox-relay:reopen", "outbox-relay-listen", "outbox-relay:reopen:replay",
            "outbox-relay:reopen:mark"}, waiting
        detail = str(waiting["detail"])
        assert "a pooler with fewer server connections than the relay needs?" in detail, detail
        assert f"the relay needs {NEEDED} connections: claims and leases (outbox-relay:reopen)" in detail, detail
        assert pending(outbox_db) == 20 and relay.alive
    relay.wait_for_log("database_connection_ready", timeout_s=60, since=since)
    wait_drained(outbox_db, timeout_s=60)
    _stop_cleanly(relay)


@pytest.mark.parametrize("rows", [20, 200], ids=["marked-on-the-loops-thread", "marked-on-the-mark-thread"])
def test_the_mark_connection_reopened_with_no_server_free_is_named_as_at_start(
        outbox_db, pgbouncer, broker, topic, spawn, rows):  # noqa: F811 - the imported fixture
    """The mark connection re-opens on the thread that marks (the mark thread's; the loop's for
    a batch of up to 64 rows of a drained outbox, relay/pump_settle.py), at its next mark after
    it broke: with its server taken by another client, marking stopped without a word (rows
    published, never marked)."""
    # A server more than the relay holds: while the relay is held up its wait watch opens a
    # connection too (relay/waits.py), which would otherwise take the last server freed.
    pooled = pgbouncer("session", pool_size=NEEDED + 1)
    relay = _started_relay(spawn, pooled, broker, "remark")
    insert_rows(outbox_db, topic, 20, keys=4)
    wait_drained(outbox_db, timeout_s=60)
    assert _end_session(outbox_db, MARK) == 1
    # Two take the server the mark connection had and the spare one; the third, queued, the
    # LISTEN connection's, which the relay closes once it saw the broken mark's error.
    with _other_clients(pooled, 3) as clients:
        wait_until(lambda: sum(served.is_set() for served, _ in clients) == 2, timeout_s=30,
                   message="no other clients got the mark connection's and the spare server")
        insert_rows(outbox_db, topic, rows, keys=4, start=20)
        wait_until(lambda: any(_named(relay.log_text(), "database_connection_waiting", name)
                               for name in (MARK, LISTEN)),
                   timeout_s=40, message=lambda: f"no connection was named: {_tail(relay.log_text())}")
        if not _named(relay.log_text(), "database_connection_waiting", MARK):
            # The loop opened LISTEN again before it marked, and waits for it: a server for
            # it (first in the pooler's queue), and the loop goes on to mark.
            clients[-1][1].set()
        wait_until(lambda: _named(relay.log_text(), "database_connection_waiting", MARK),
                   timeout_s=40, message=lambda: f"the mark connection was not named: {_tail(relay.log_text())}")
        waiting = next(event for event in _events(relay.log_text(), "database_connection_waiting")
                       if event["connection"] == MARK)
        assert waiting["reopened"] is True, waiting
        assert waiting["level"] == "warning" and waiting["needed"] == NEEDED, waiting
        detail = str(waiting["detail"])
        assert detail.startswith("could not get connection 3 of 4 (outbox-relay:remark:mark: marks) within"), detail
        assert "a pooler with fewer server connections than the relay needs?" in detail, detail
        assert pending(outbox_db) == rows and relay.alive
    wait_until(lambda: _named(relay.log_text(), "database_connection_ready", MARK),
               timeout_s=60, message=lambda: f"the mark connection was not ready: {_tail(relay.log_text())}")
    wait_drained(outbox_db, timeout_s=60)
    _stop_cleanly(relay)


def test_the_cleanup_connection_reopened_with_no_server_free_is_named_as_at_start(
        outbox_db, pgbouncer, broker, topic, spawn):  # noqa: F811 - the imported fixture
    """The cleanup connection (--cleanup-retention-s) re-opens on the cleanup thread, at the
    round after it broke: with its server taken by another client, retention stopped without
    a word (one cleanup_database_unavailable, never a cleanup_recovered)."""
    needed = NEEDED + 1  # and cleanup's
    pooled = pgbouncer("session", pool_size=needed)
    relay = _started_relay(spawn, pooled, broker, "reclean", cleanup_retention_s=3600, cleanup_interval_s=0.5)
    assert _end_session(outbox_db, "outbox-relay:reclean:cleanup") == 1
    with _other_clients(pooled, 1) as clients:
        wait_until(clients[0][0].is_set, timeout_s=30, message="no other client got the cleanup connection's server")
        wait_until(lambda: _named(relay.log_text(), "database_connection_waiting", "outbox-relay:reclean:cleanup"),
                   timeout_s=40, message=lambda: f"the cleanup connection was not named: {_tail(relay.log_text())}")
        waiting = next(event for event in _events(relay.log_text(), "database_connection_waiting")
                       if event["connection"] == "outbox-relay:reclean:cleanup")
        assert waiting["reopened"] is True and waiting["needed"] == needed, waiting
        detail = str(waiting["detail"])
        assert detail.startswith("could not get connection 5 of 5 (outbox-relay:reclean:cleanup: retention and "
                                 "partitions) within"), detail
        insert_rows(outbox_db, topic, 20, keys=4)
        wait_drained(outbox_db, timeout_s=60)  # marking goes on meanwhile
    relay.wait_for_log("cleanup_recovered", timeout_s=60)
    _stop_cleanly(relay)


def _seen_until(dsn: str, owner: str) -> datetime:
    """Until when the relay ``owner``'s last heartbeat (on the loop's thread) says it lives."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT seen_until FROM outbox_relay_replicas WHERE owner = %s", (owner,)).fetchone()
        assert row is not None, f"no replica {owner}"
        return row[0]


def test_a_small_batch_whose_mark_connection_waits_to_reopen_does_not_hold_the_loop(
        outbox_db, pgbouncer, broker, topic, spawn):  # noqa: F811 - the imported fixture
    """A small batch of a drained outbox (up to 64 rows) is marked on the loop's thread;
    once its mark connection broke, its re-open waited there in the pooler's queue, and the
    loop with it: no heartbeat (leases expire), no claim, then a heartbeat_late of the whole
    wait.  Now such a batch goes to the mark thread, which waits; the loop goes on."""
    owner, mark = "inline", "outbox-relay:inline:mark"
    pooled = pgbouncer("session", pool_size=NEEDED + 1)  # a spare, for the wait watch
    relay = _started_relay(spawn, pooled, broker, owner, heartbeat_interval_s=1, claim_interval_s=0,
                           claim_interval_max_s=0)
    insert_rows(outbox_db, topic, 20, keys=4)
    wait_drained(outbox_db, timeout_s=60)
    assert _end_session(outbox_db, mark) == 1
    # Two take the server the mark connection had and the spare one: once the relay saw the
    # broken mark's error (the next batch's, on the loop's thread), its claims and LISTEN
    # connections, closed after it, get theirs back; the mark connection has none.
    with _other_clients(pooled, 2) as clients:
        wait_until(lambda: all(served.is_set() for served, _ in clients), timeout_s=30,
                   message="no other clients got the mark connection's and the spare server")
        insert_rows(outbox_db, topic, 20, keys=4, start=20)
        wait_until(lambda: _named(relay.log_text(), "database_connection_waiting", mark),
                   timeout_s=40, message=lambda: f"the mark connection was not named: {_tail(relay.log_text())}")
        seen = _seen_until(outbox_db, owner)
        # Two heartbeats (one a second) while the mark connection still waits.
        wait_until(lambda: _seen_until(outbox_db, owner) > seen + timedelta(seconds=2), timeout_s=15, message=lambda: f"the loop stopped its heartbeats while the mark "
                                                 f"connection waited: {_tail(relay.log_text())}")
        assert not _named(relay.log_text(), "database_connection_ready", mark)
        assert pending(outbox_db) == 20 and relay.alive
    wait_until(lambda: _named(relay.log_text(), "database_connection_ready", mark),
               timeout_s=60, message=lambda: f"the mark connection was not ready: {_tail(relay.log_text())}")
    wait_drained(outbox_db, timeout_s=60)  # every row marked, once
    late = [event["late_s"] for event in _events(relay.log_text(), "heartbeat_late")]
    assert all(float(str(each)) < 3.0 for each in late), late
    _stop_cleanly(relay)


@contextmanager
def _queued_client(pooled: str) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Another client of the pool whose first query is written to the pooler when the block
    begins (so it is first in the pooler's queue for the next server that comes free),
    holding that server once served, until the block ends or its release is set:
    (served, release)."""
    sent, served, release = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with psycopg.connect(pooled, autocommit=True) as conn:
            pgconn = conn.pgconn
            pgconn.send_query(b"SELECT 1")
            while pgconn.flush():
                select.select([], [pgconn.socket], [], 1.0)
            sent.set()
            while pgconn.is_busy():  # the reply, without blocking in libpq
                select.select([pgconn.socket], [], [], 1.0)
                pgconn.consume_input()
            while pgconn.get_result() is not None:
                pass
            served.set()
            release.wait(120)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        assert sent.wait(30), "the other client could not send its query to the pooler"
        yield served, release
    finally:
        release.set()
        thread.join(30)


def _sessions(dsn: str, application_name: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND application_name = %s", (application_name,)).fetchone()
    return int(row[0]) if row else 0


def _listen_sleeps(dsn: str) -> bool:
    """The LISTEN connection's session holds the wake-up lock (an advisory lock): the relay
    sleeps on it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database() "
            "AND a.application_name = %s", (LISTEN,)).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("then", ["served", "stopped"])
def test_the_listen_connection_reopened_with_no_server_free_does_not_hold_the_loop(
        outbox_db, pgbouncer, broker, topic, spawn, then):  # noqa: F811 - the imported fixture
    """LISTEN only speeds discovery.  Once its connection broke, its re-open ran on the loop's
    thread and waited there in the pooler's queue (a pool of the relay's size, another client
    first in line for the server it had): no claim, no mark, though the claims connection
    worked.  Now it re-opens on a thread of its own and the loop polls meanwhile: rows written
    then are published while LISTEN still waits; once served, the relay sleeps on it again,
    and a stop while it waits ends the relay at once."""
    owner = "relisten"
    pooled = pgbouncer("session", pool_size=NEEDED)
    relay = _started_relay(spawn, pooled, broker, owner)
    insert_rows(outbox_db, topic, 20, keys=4)
    wait_drained(outbox_db, timeout_s=60)
    wait_until(lambda: _listen_sleeps(outbox_db), timeout_s=30, message="the relay never slept on LISTEN")
    with _queued_client(pooled) as (served, release):
        assert not served.is_set()  # every server is the relay's
        assert _end_session(outbox_db, LISTEN) == 1
        wait_until(served.is_set, timeout_s=30, message="the other client did not get LISTEN's server")
        wait_until(lambda: _named(relay.log_text(), "database_connection_waiting", LISTEN), timeout_s=40,
                   message=lambda: f"the LISTEN connection was not named: {_tail(relay.log_text())}")
        insert_rows(outbox_db, topic, 40, keys=4, start=20)
        wait_drained(outbox_db, timeout_s=30)  # polled and marked while LISTEN waits
        _delivered_in_order(outbox_db, broker, topic)
        assert not _named(relay.log_text(), "database_connection_ready", LISTEN)
        assert _sessions(outbox_db, LISTEN) == 0 and relay.alive  # LISTEN still waits
        if then == "stopped":
            relay.sigterm()  # the attempt is abandoned (its server may come as the relay closes)
            assert relay.wait(20) == 0
            assert _events(relay.log_text(), "relay_stopped") and "Traceback" not in relay.log_text()
            return
        release.set()
    wait_until(lambda: _named(relay.log_text(), "database_connection_ready", LISTEN), timeout_s=60,
               message=lambda: f"the LISTEN connection was not ready: {_tail(relay.log_text())}")
    wait_until(lambda: _listen_sleeps(outbox_db), timeout_s=30, message="the relay did not sleep on LISTEN again")
    insert_rows(outbox_db, topic, 20, keys=4, start=60)
    wait_drained(outbox_db, timeout_s=30)
    _delivered_in_order(outbox_db, broker, topic)
    _stop_cleanly(relay)


def test_the_replay_connection_reopened_with_no_server_free_does_not_hold_the_loop(
        outbox_db, pgbouncer, broker, topic, spawn):  # noqa: F811 - the imported fixture
    """Only the replays' connection broke, in a pool of the relay's size with other clients
    first in line: the relay said the database was down (database_unavailable), and re-opened
    that connection on the loop's thread, which waited in the pooler's queue: no claim, no
    mark, for replays.  Now it re-opens on a thread of its own, named as at start, and the
    relay publishes meanwhile."""
    owner, replay = "rereplay", "outbox-relay:rereplay:replay"
    pooled = pgbouncer("session", pool_size=NEEDED)
    relay = _started_relay(spawn, pooled, broker, owner)
    insert_rows(outbox_db, topic, 20, keys=4)
    wait_drained(outbox_db, timeout_s=60)
    with _queued_client(pooled) as (served, release), _queued_client(pooled) as (_served2, release2):
        assert _end_session(outbox_db, replay) == 1
        wait_until(served.is_set, timeout_s=30, message="the other client did not get the replays' server")
        # Its next statement (a look for replays, every 5 s) finds it broken.
        wait_until(lambda: _named(relay.log_text(), "database_connection_waiting", replay), timeout_s=60,
                   message=lambda: f"the replays' connection was not named: {_tail(relay.log_text())}")
        insert_rows(outbox_db, topic, 40, keys=4, start=20)
        wait_drained(outbox_db, timeout_s=30)  # claimed and marked while the replays' connection waits
        _delivered_in_order(outbox_db, broker, topic)
        assert not _named(relay.log_text(), "database_connection_ready", replay) and relay.alive
        assert not _events(relay.log_text(), "database_unavailable")  # the database was never down
        release2.set()  # the second client leaves as soon as it is served:
        release.set()  # the first one's server goes to it, then to the replays' connection
        wait_until(lambda: _named(relay.log_text(), "database_connection_ready", replay), timeout_s=60,
                   message=lambda: f"the replays' connection was not ready: {_tail(relay.log_text())}")
    _stop_cleanly(relay)
