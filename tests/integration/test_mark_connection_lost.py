"""The mark connection ended by the server while the database is fine, against an outage
(relay/marker.py MarkConnectionLost, relay/app_deps.py), on the real PostgreSQL and broker.

The server ended only the mark connection's backend (``pg_terminate_backend``; an
``idle_session_timeout``, a pooler dropping it, are the same to the relay): the relay said
``database_unavailable``, the line of an outage that SREs alert on, dropped its claims and
LISTEN connections and waited out a back-off.  Now it says ``mark_connection_lost`` (which
connection, the error) when the claims connection still answers, and rewinds as before: the
marks in flight are unknown, their rows are claimed again, none is lost.  An outage (every
backend of the relay ended, the server stopped) is still ``database_unavailable``; the mark
connection found broken at its first mark after it is part of it (``mark_connection_stale``).
Each event is counted at the broker and marked in the database."""

from __future__ import annotations

import json
import time
import urllib.request

import psycopg
from prometheus_client.parser import text_string_to_metric_families

from relay.connections import application_name
from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    Writer,
    all_event_ids,
    check_delivery,
    insert_rows,
    migrated,
    pending,
    relay_cmd,
    relay_env,
    scalar,
    wait_drained,
)
from tests.fixtures.procs import Proc, free_port, wait_until

#: Rows a tick of the writer commits (over as many keys), every 20 ms while events flow.
PER_TICK = 10


def _events(proc: Proc, name: str, since: int = 0) -> list[dict[str, object]]:
    found = []
    for line in proc.log_text()[since:].splitlines():
        if f'"{name}"' in line and line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == name:
                found.append(dict(event))
    return found


def _backend(dsn: str, name: str) -> int | None:
    """The backend pid of the relay's connection called ``name`` (None: it has none now)."""
    pid = scalar(dsn, "SELECT max(pid) FROM pg_stat_activity WHERE datname = current_database() "
                      "AND application_name = %(name)s", {"name": name})
    return None if pid is None else int(pid)


def _marked(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"))


def _end_backends(dsn: str, names: list[str]) -> list[str]:
    """End the backends of the connections called ``names``, in that order, each waited for
    (gone before the next one is ended); returns the names of those ended (one the relay
    closed meanwhile is not)."""
    ended = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            for (pid,) in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                       "AND application_name = %s", (name,)).fetchall():
                row = conn.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone()
                if row and row[0]:
                    ended.append(name)
    return ended


def _relay_names(dsn: str) -> list[str]:
    """The application names of the relay's connections to ``dsn`` now, the claims'
    (``outbox-relay:<owner>``, the shortest of its owner's) first."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT DISTINCT application_name FROM pg_stat_activity "
                            "WHERE datname = current_database() AND application_name LIKE 'outbox-relay%%'"
                            ).fetchall()
    return sorted((str(name) for (name,) in rows), key=lambda name: (name.count(":") != 1, name))


def _flowing(dsn: str, marked: int) -> None:
    """Wait until ``marked`` more rows than now are marked: events flow and are marked."""
    target = _marked(dsn) + marked
    wait_until(lambda: _marked(dsn) >= target, timeout_s=60,
               message=lambda: f"marks did not go on: {_marked(dsn)} marked, {pending(dsn)} pending")


def _all_published_and_marked(dsn: str, proc: Proc, broker: str, topic: str, written: int) -> None:
    """Every event written reached the broker (once or more, first copies in key order) and
    is marked; the relay stops cleanly."""
    wait_drained(dsn, timeout_s=90)
    expected = all_event_ids(dsn)
    assert len(expected) == written and _marked(dsn) == written and pending(dsn) == 0
    proc.sigterm()
    assert proc.wait(30) == 0, proc.log_tail()
    delivery = check_delivery(read_all(broker, topic, expected=expected, timeout_s=90), expected)
    assert delivery.missing == set() and delivery.order_violations == [], delivery
    assert len(delivery.unique) == written


def _losses_counted(port: int, name: str) -> float | None:
    """outbox_relay_mark_connection_losses_total of the connection ``name``, as /metrics shows it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "outbox_relay_mark_connection_losses_total" and sample.labels["connection"] == name:
                return float(sample.value)
    return None


def test_a_mark_connection_the_server_ended_is_said_as_that_and_its_rows_are_claimed_again(
        outbox_db, broker, topic, spawn):
    """Ended twice in a row: said once (the streak), counted twice, and the second re-open
    waits a back-off (2 s): before, each loss was a line and re-opened at the next mark."""
    owner = "marklost"
    claims, mark = application_name(owner, ""), application_name(owner, ":mark")
    port = free_port()
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, broker.bootstrap, owner=owner, metrics_port=port),
                  name="relay")
    reopened_after: list[float] = []
    with Writer(outbox_db, topic, keys=PER_TICK, per_tick=PER_TICK) as writer:
        _flowing(outbox_db, 200)
        claims_pid = _backend(outbox_db, claims)
        for ended in (1, 2):  # twice in a row
            pid = _backend(outbox_db, mark)
            assert pid is not None and _end_backends(outbox_db, [mark]) == [mark]
            ended_at = time.monotonic()
            wait_until(lambda: _losses_counted(port, mark) == ended, timeout_s=60,  # noqa: B023
                       message=lambda: f"not counted: {relay.log_tail()}")
            wait_until(lambda: _backend(outbox_db, mark) not in (None, pid), timeout_s=60,  # noqa: B023
                       message="the mark connection was not re-opened")
            reopened_after.append(time.monotonic() - ended_at)
            _flowing(outbox_db, 200)  # and marks on it go on
    (lost,) = _events(relay, "mark_connection_lost")
    assert lost["connection"] == mark, lost
    assert "terminating connection due to administrator command" in str(lost["error"]), lost
    assert "re-claimed" in str(lost["detail"]) and "back-off" in str(lost["detail"]), lost
    assert reopened_after[1] >= 1.5, reopened_after  # the second loss in a row: 2 s back-off
    # Not an outage: not said as one, and the claims connection was kept.
    assert not _events(relay, "database_unavailable") and not _events(relay, "mark_connection_stale")
    assert _backend(outbox_db, claims) == claims_pid
    _all_published_and_marked(outbox_db, relay, broker.bootstrap, topic, writer.written)


def test_every_backend_of_the_relay_ended_is_still_the_database_unavailable(outbox_db, broker, topic, spawn):
    owner = "allended"
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, broker.bootstrap, owner=owner), name="relay")
    with Writer(outbox_db, topic, keys=PER_TICK, per_tick=PER_TICK) as writer:
        _flowing(outbox_db, 200)
        names = _relay_names(outbox_db)
        assert names[0] == application_name(owner, "") and application_name(owner, ":mark") in names, names
        since = relay.log_size()
        ended = _end_backends(outbox_db, names)
        assert ended[0] == names[0] and application_name(owner, ":mark") in ended, (names, ended)
        wait_until(lambda: _events(relay, "database_unavailable", since), timeout_s=60,
                   message=lambda: f"the outage was not said: {relay.log_tail()}")
        wait_until(lambda: _events(relay, "database_recovered", since), timeout_s=60,
                   message=lambda: f"the recovery was not said: {relay.log_tail()}")
        _flowing(outbox_db, 200)
    # The mark connection ended with the others is the outage's, never said as its own loss.
    assert not _events(relay, "mark_connection_lost"), _events(relay, "mark_connection_lost")
    _all_published_and_marked(outbox_db, relay, broker.bootstrap, topic, writer.written)


def test_a_database_stopped_is_still_the_database_unavailable(own_db_dsn, own_pg_running, broker, topic, spawn):
    dsn = migrated(own_db_dsn)
    relay = spawn(relay_cmd("run"), env=relay_env(dsn, broker.bootstrap, owner="stopped"), name="relay")
    with Writer(dsn, topic, keys=PER_TICK, per_tick=PER_TICK) as writer:
        _flowing(dsn, 200)
    wait_drained(dsn, timeout_s=60)  # the mark connection idle: found broken only after the restart
    since = relay.log_size()
    own_pg_running.stop()
    relay.wait_for_log("database_unavailable", timeout_s=30, since=since)
    own_pg_running.start()
    relay.wait_for_log("database_recovered", timeout_s=60, since=since)
    insert_rows(dsn, topic, 500, keys=PER_TICK, start=writer.written)  # marked after the recovery
    wait_drained(dsn, timeout_s=90)
    # Its mark connection, found broken at the first mark after the restart, is the outage's.
    assert not _events(relay, "mark_connection_lost"), _events(relay, "mark_connection_lost")
    (stale,) = _events(relay, "mark_connection_stale", since)
    assert stale["connection"] == application_name("stopped", ":mark"), stale
    assert len(_events(relay, "database_unavailable", since)) == 1, relay.log_tail()
    _all_published_and_marked(dsn, relay, broker.bootstrap, topic, writer.written + 500)


def test_a_second_mark_connection_broken_in_the_same_outage_is_still_the_outages(outbox_db, broker, topic, spawn):
    """Two mark connections, both ended with every backend of the relay: the first marks again
    (small batches go to it alone) before the second gets a mark, found broken then.  The
    first's mark cleared one flag for both, and the second was said ``mark_connection_lost``
    (a warning: a pooler ending it?) when it broke in the outage like the first."""
    owner = "twomarks"
    marks = [application_name(owner, ":mark"), application_name(owner, ":mark2")]
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, broker.bootstrap, owner=owner, mark_connections=2),
                  name="relay")
    written = 0
    while not _events(relay, "mark_connection_ready"):  # the second is probed at a large batch
        assert written < 20_000, relay.log_tail()  # after the first connection's first mark
        insert_rows(outbox_db, topic, 1000, keys=50, start=written)
        written += 1000
        wait_drained(outbox_db, timeout_s=60)
    assert _backend(outbox_db, marks[1]) is not None
    since = relay.log_size()
    ended = _end_backends(outbox_db, _relay_names(outbox_db))
    assert set(marks) <= set(ended), ended
    relay.wait_for_log("database_recovered", timeout_s=60, since=since)
    insert_rows(outbox_db, topic, 50, keys=50, start=written)  # one small batch: the first connection's
    wait_drained(outbox_db, timeout_s=60)
    insert_rows(outbox_db, topic, 3000, keys=50, start=written + 50)  # split again: the second's turn
    wait_drained(outbox_db, timeout_s=60)
    assert not _events(relay, "mark_connection_lost", since), _events(relay, "mark_connection_lost", since)
    stale = _events(relay, "mark_connection_stale", since)
    assert sorted(str(each["connection"]) for each in stale) == marks, stale
    _all_published_and_marked(outbox_db, relay, broker.bootstrap, topic, written + 3050)
