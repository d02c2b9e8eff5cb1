"""The wait watch (relay/waits.py) does not look while a mark connection waits for its
re-open (relay/connections.py names that wait): behind a session pool of the relay's size
its look took the server the re-open waited for, and held it while the marks waited (the
relay's marks held up for good; seen once the loop no longer waits on a small batch's
mark, tests/integration/test_pgbouncer_reconnect.py).  The loop's own hold-ups are looked
at as before."""

from __future__ import annotations

from types import SimpleNamespace

import structlog

from relay.app import Relay
from relay.config import build_settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_marks_held_up_by_a_mark_connections_reopen_are_not_looked_at() -> None:
    clock = Clock()
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1/db", "owner": "r1",
                               "bootstrap_servers": "127.0.0.1:9092"})
    relay = Relay(settings, log=structlog.get_logger(), clock=clock)
    relay.pump = SimpleNamespace(last_marked_at=clock.now, busy=lambda: True, marks_cancelled=lambda: False)  # type: ignore[assignment]
    relay._db_ok()
    clock.now += 60
    relay.last_tick = clock.now  # the loop turns; its marks wait
    held_up_s = relay.waits._held_up_s
    assert held_up_s() == 60.0  # looked at: a lock, say
    relay.mark_stores[0].needs_reopen = True  # type: ignore[attr-defined] # it broke, its re-open waits
    assert held_up_s() == 0.0
    relay.mark_stores[0].needs_reopen = False  # type: ignore[attr-defined] # re-opened
    assert held_up_s() == 60.0
