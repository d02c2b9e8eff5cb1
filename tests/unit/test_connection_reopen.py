"""The loop's connections re-opened at run time are checked as at start (relay/connections.py):
after a database error the loop's stores, and LISTEN's each time it re-opens itself; one
that takes too long is named with the count the relay needs, as at start."""

from __future__ import annotations

import threading

from relay.connections import Checks, Needed


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []
        self.warned = threading.Event()

    def warning(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))
        self.warned.set()

    def info(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))


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
