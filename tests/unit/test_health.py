"""/healthz: a stuck loop fails it; the minutes of a dependency's outage never do."""

from __future__ import annotations

from types import SimpleNamespace

import structlog

from relay.app import Relay
from relay.config import build_settings
from relay.publisher import BrokerState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def relay_at(clock: Clock) -> Relay:
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1/db",
                               "bootstrap_servers": "127.0.0.1:9092", "stuck_after_s": "120"})
    relay = Relay(settings, log=structlog.get_logger(), clock=clock)
    relay.pump = SimpleNamespace(last_marked_at=clock.now, marks_cancelled=lambda: False)  # type: ignore[assignment]
    relay._db_ok()
    relay.pending = 50
    return relay


def healthy(relay: Relay, clock: Clock) -> bool:
    relay.last_tick = clock.now  # the loop turns; only publishing is in question
    return relay.health()[0]


def test_pending_rows_and_nothing_published_for_stuck_after_s_fails() -> None:
    clock = Clock()
    relay = relay_at(clock)
    clock.now += 119
    assert healthy(relay, clock)
    clock.now += 2
    assert not healthy(relay, clock)


def test_marks_the_server_cancels_and_the_relay_marks_again_are_not_stuck() -> None:
    """A lock on outbox rows, a statement_timeout: the marks are tried again (relay/mark_cancels.py),
    and a restart would publish again every row in flight; once they stop, stuck is stuck."""
    clock = Clock()
    relay = relay_at(clock)
    cancelling = [True]
    relay.pump.marks_cancelled = lambda: cancelling[0]  # type: ignore[method-assign,union-attr]
    clock.now += 600
    relay.last_tick = clock.now  # the loop turns; only publishing is in question
    ok, body = relay.health()
    assert ok and body["marks_cancelled"] is True, body
    cancelling[0] = False
    assert not healthy(relay, clock)


def test_the_first_seconds_after_a_five_minute_broker_outage_are_healthy() -> None:
    # CI, 2026-12-01: one 503 right after the broker came back, between the first
    # acknowledgement (broker_up again) and the mark that followed it.
    clock = Clock()
    relay = relay_at(clock)
    clock.now += 10
    relay._client_error(BrokerState.UNREACHABLE, "all brokers down", fatal=False)
    for _ in range(30):  # five minutes down: readiness's business, not liveness's
        clock.now += 10
        assert healthy(relay, clock)
    relay._broker_ok()  # acknowledged; the mark is still on its way
    clock.now += 1
    assert healthy(relay, clock)
    clock.now += 119  # back for stuck_after_s and still nothing marked: stuck after all
    assert healthy(relay, clock)
    clock.now += 2
    assert not healthy(relay, clock)


def test_the_database_coming_back_restarts_the_clock_too() -> None:
    clock = Clock()
    relay = relay_at(clock)
    relay._db_down(RuntimeError("connection refused"))
    clock.now += 600
    assert healthy(relay, clock)
    relay._db_ok()
    clock.now += 5
    assert healthy(relay, clock)
