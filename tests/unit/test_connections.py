"""The relay's connections (relay/connections.py): at start, one that takes too long is
named with the count the relay needs, errors reach the caller and a stop ends the wait; at
run time, the loop's stores after a database error and LISTEN's on each re-open (Checks),
and the mark and cleanup connections on their own threads (CheckedStore), are checked the
same way: a re-open that waits is named with the start's message, a stop while it waits
ends it at once, and an open connection costs no check."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from relay import store as store_module
from relay.connections import Checks, Needed, acquire, needs_text, relay_needs
from relay.errors import DatabaseUnavailable
from relay.reopening import CheckedStore


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []
        self.warned = threading.Event()

    def warning(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))
        self.warned.set()

    def info(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))


def test_a_connection_that_does_not_come_is_named_and_waited_for() -> None:
    log = Log()
    opened: list[str] = []

    def pooled() -> None:  # answers once the warning is out, as a freed server would
        assert log.warned.wait(10)
        opened.append("b")

    needed = [Needed("a", "claims and leases", lambda: opened.append("a")), Needed("b", "replays", pooled)]
    acquire(needed, log=log, stopping=lambda: False, optional=1, within_s=0.05)
    assert opened == ["a", "b"]
    (event, fields), (ready, _) = log.events
    assert event == "database_connection_waiting" and ready == "database_connection_ready"
    assert fields["number"] == 2 and fields["needed"] == 2 and fields["connection"] == "b"
    assert str(fields["detail"]).startswith(
        "could not get connection 2 of 2 (b: replays) within 0 s: a pooler with fewer server "
        "connections than the relay needs? the relay needs 2 connections: claims and leases (a), "
        "replays (b), and up to 1 more for marks")


def test_an_error_is_raised_and_a_stop_ends_the_wait() -> None:
    def down() -> None:
        raise DatabaseUnavailable("database unreachable")

    with pytest.raises(DatabaseUnavailable):
        acquire([Needed("a", "claims", down)], log=Log(), stopping=lambda: False)
    never = threading.Event()
    stop = threading.Event()
    log = Log()
    threading.Timer(0.2, stop.set).start()
    acquire([Needed("a", "claims", lambda: never.wait(30) and None)], log=log, stopping=stop.is_set,
            within_s=0.05)
    assert [event for event, _ in log.events] == ["database_connection_waiting"]
    never.set()


def test_the_default_relay_needs_four_and_cleanup_and_exactly_once_add_theirs() -> None:
    class Pings:
        def ping(self) -> None: ...

    p = Pings()
    names = [n.name for n in relay_needs(lambda role: "outbox-relay:o" + role, store=p, wakeup=p,
                                         mark_store=p, replay_store=p)]
    assert names == ["outbox-relay:o", "outbox-relay-listen", "outbox-relay:o:mark", "outbox-relay:o:replay"]
    more = relay_needs(lambda role: "r" + role, store=p, wakeup=p, mark_store=p, replay_store=p,
                       cleanup_store=p, recovery_store=p)
    assert "the relay needs 6 connections" in needs_text(more)


def test_after_a_database_error_only_the_loops_stores_are_opened_again() -> None:
    opened: list[str] = []
    needed = [Needed("claims", "claims and leases", lambda: opened.append("claims"), recheck=True),
              Needed("listen", "LISTEN", lambda: opened.append("listen")),
              Needed("mark", "marks", lambda: opened.append("mark")),
              Needed("replay", "replays", lambda: opened.append("replay"), recheck=True)]
    checks = Checks(needed, log=Log(), stopping=lambda: False)
    checks.at_start()
    assert opened == ["claims", "listen", "mark", "replay"]
    opened.clear()
    assert checks.reopened()
    assert opened == ["claims", "replay"]  # the mark thread's is its own; LISTEN checks itself


def test_a_reopen_that_waits_is_named_as_at_start(monkeypatch) -> None:
    monkeypatch.setattr("relay.connections.CONNECTION_WAIT_S", 0.05)
    log = Log()
    reopened: list[str] = []

    def pooled() -> None:  # answers once the warning is out, as a freed server would
        assert log.warned.wait(10)
        reopened.append("listen")

    needed = [Needed("claims", "claims and leases", lambda: None, recheck=True),
              Needed("listen", "LISTEN and the wake-up lock", lambda: None)]
    Checks(needed, log=log, stopping=lambda: False).reopen("listen", pooled)
    assert reopened == ["listen"]
    (event, fields), (ready, ready_fields) = log.events
    assert event == "database_connection_waiting" and ready == "database_connection_ready"
    assert fields["reopened"] is True and ready_fields["reopened"] is True
    assert str(fields["detail"]).startswith(
        "could not get connection 2 of 2 (listen: LISTEN and the wake-up lock) within 0 s: a pooler "
        "with fewer server connections than the relay needs? the relay needs 2 connections")


class Conn:
    """A connection whose first statement waits for ``served`` (a pooler's queue)."""

    def __init__(self, served: threading.Event) -> None:
        self.closed = False
        self.served = served

    def execute(self, *_args: Any, **_kwargs: Any) -> None:
        assert self.served.wait(10), "never served"

    def close(self) -> None:
        self.closed = True


class CountedChecks(Checks):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reopens = 0

    def reopen(self, name: str, open_: Any) -> bool:
        self.reopens += 1
        return super().reopen(name, open_)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Connections opened from now on wait at their first statement until it is set."""
    event = threading.Event()
    monkeypatch.setattr(store_module, "connect", lambda *_a, **_k: Conn(event))
    monkeypatch.setattr("relay.connections.CONNECTION_WAIT_S", 0.05)
    return event


def _mark_store(log: Log, stopping: threading.Event, name: str = "relay:mark") -> tuple[CheckedStore, CountedChecks]:
    needed = [Needed("relay", "claims and leases", lambda: None, recheck=True),
              Needed("relay:mark", "marks", lambda: None)]
    checks = CountedChecks(needed, log=log, stopping=stopping.is_set, optional=1)
    store = CheckedStore("dbname=x", application_name=name)
    checks.check_reopens(store, object())  # anything else is left alone
    return store, checks


def _on_a_thread_of_its_own(store: CheckedStore) -> tuple[threading.Thread, list[BaseException]]:
    failed: list[BaseException] = []

    def mark() -> None:
        try:
            store.conn  # noqa: B018 - the statement's connection, re-opened
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            failed.append(exc)

    thread = threading.Thread(target=mark, name="outbox-relay-mark")
    thread.start()
    return thread, failed


def test_a_reopen_on_the_mark_thread_that_waits_is_named_as_at_start(served: threading.Event) -> None:
    log, stopping = Log(), threading.Event()
    store, checks = _mark_store(log, stopping)
    served.set()
    first = store.conn  # its first open: the start's check, not a re-open's
    assert checks.reopens == 0 and store.conn is first and checks.reopens == 0  # open: no check
    store.reset()  # a statement failed
    served.clear()
    thread, failed = _on_a_thread_of_its_own(store)
    assert log.warned.wait(10)
    served.set()  # a server came free
    thread.join(10)
    assert not thread.is_alive() and not failed and checks.reopens == 1
    (event, fields), (ready, ready_fields) = log.events
    assert event == "database_connection_waiting" and ready == "database_connection_ready"
    assert fields["connection"] == "relay:mark" and fields["reopened"] is True, fields
    assert str(fields["detail"]).startswith(
        "could not get connection 2 of 2 (relay:mark: marks) within 0 s: a pooler with fewer server "
        "connections than the relay needs? the relay needs 2 connections"), fields
    assert ready_fields["connection"] == "relay:mark" and ready_fields["reopened"] is True


def test_a_stop_while_a_reopen_waits_ends_the_thread_at_once(served: threading.Event) -> None:
    log, stopping = Log(), threading.Event()
    store, _checks = _mark_store(log, stopping)
    served.set()
    store.conn  # noqa: B018 - opened once
    store.reset()
    served.clear()  # no server comes free
    thread, failed = _on_a_thread_of_its_own(store)
    assert log.warned.wait(10)
    stopping.set()
    thread.join(2)
    assert not thread.is_alive()
    assert len(failed) == 1 and isinstance(failed[0], DatabaseUnavailable), failed
    assert "stopped while waiting for the connection relay:mark" in str(failed[0])
    served.set()  # the abandoned attempt ends


def test_an_optional_mark_connection_is_checked_on_reopen_only(served: threading.Event) -> None:
    log, stopping = Log(), threading.Event()
    store, checks = _mark_store(log, stopping, name="relay:mark2")
    served.clear()
    probe, failed = _on_a_thread_of_its_own(store)  # its first open: its lane's probe's
    probe.join(0.3)
    assert probe.is_alive() and checks.reopens == 0 and not log.events
    served.set()
    probe.join(10)
    store.reset()
    served.clear()
    thread, failed = _on_a_thread_of_its_own(store)
    assert log.warned.wait(10)
    served.set()
    thread.join(10)
    assert not failed and checks.reopens == 1
    fields = log.events[0][1]
    assert fields["connection"] == "relay:mark2" and str(fields["detail"]).startswith(
        "could not get an optional connection (relay:mark2: marks, optional) within"), fields


def test_a_mark_store_says_when_its_next_statement_reopens_its_connection(served: threading.Event) -> None:
    """The pump's test before a mark on its own thread (relay/pump_settle.py): a connection
    that broke (its statement failed, the store dropped it) must be re-opened, which may
    wait; an open one, or one never opened (the start's check opens it), need not."""
    log, stopping = Log(), threading.Event()
    store, _checks = _mark_store(log, stopping)
    assert not store.needs_reopen
    served.set()
    store.conn  # noqa: B018 - opened once
    assert not store.needs_reopen
    store.reset()  # a statement failed
    assert store.needs_reopen
    store.conn  # noqa: B018 - re-opened
    assert not store.needs_reopen
    store.conn.closed = True  # the driver found it broken, with an error that does not drop it
    with pytest.raises(psycopg.DataError):
        store._failed(psycopg.DataError("lost"))
    assert store.needs_reopen


def test_the_exactly_once_recovery_connection_reopened_is_named_as_at_start(served: threading.Event) -> None:
    """The exactly-once recovery connection (relay/app.py, its shard workers' recoveries)
    re-opens at its next statement after it broke, as the mark connections do: it is
    checked the same way (before: never named, it waited in the pooler's queue unsaid)."""
    from relay.app import Relay
    from relay.config import build_settings
    from relay.connections import application_name

    settings = build_settings({"dsn": "postgresql://u@127.0.0.1/db", "bootstrap_servers": "127.0.0.1:9092",
                               "owner": "eo", "exactly_once": "true"})
    log, stopping = Log(), threading.Event()
    relay = Relay(settings, log=log)
    recovery = relay._recovery
    assert recovery is not None
    relay.connections = Checks(relay_needs(lambda role: application_name("eo", role), store=relay.store,
                                           wakeup=relay.wakeup, mark_store=relay.mark_stores[0],
                                           replay_store=relay.store, recovery_store=recovery),
                               log=log, stopping=stopping.is_set)
    served.set()
    recovery.conn  # noqa: B018 - opened by the start's check
    relay._check_reopens()
    recovery.reset()  # a statement failed
    served.clear()
    thread, failed = _on_a_thread_of_its_own(recovery)  # type: ignore[arg-type]
    named = log.warned.wait(5)
    served.set()  # a server came free
    thread.join(10)
    assert named, "the recovery connection's re-open was not named"
    assert not failed
    fields = log.events[0][1]
    assert fields["connection"] == "outbox-relay:eo:exactly-once" and fields["reopened"] is True, fields
    assert str(fields["detail"]).startswith(
        "could not get connection 5 of 5 (outbox-relay:eo:exactly-once: exactly-once recovery) within"), fields
