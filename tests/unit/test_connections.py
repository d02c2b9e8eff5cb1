"""The relay's connections at start (relay/connections.py): one that takes too long is named
with the count the relay needs; errors reach the caller; a stop ends the wait."""

from __future__ import annotations

import threading

import pytest

from relay.connections import Needed, acquire, needs_text, relay_needs
from relay.errors import DatabaseUnavailable


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
