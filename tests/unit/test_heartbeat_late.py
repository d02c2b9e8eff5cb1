"""heartbeat_late: logged when the loop ran a heartbeat a whole interval late, once a
turn; not while the database is away (retries wait out their back-off, and
database_unavailable already said why)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from relay.app import Relay
from relay.config import build_settings
from relay.leases import LeaseChange
from relay.model import BatchResult


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append((event, kw))


class Leases:
    heartbeat_s, lease_s, leases, releasing = 1.0, 3.0, {}, frozenset()

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.due_at = 0.0  # never ran

    def due(self, now: float) -> bool:
        return now >= self.due_at

    def next_due(self) -> float:
        return self.due_at

    def run_once(self, busy: Any) -> LeaseChange:
        self.due_at = self.clock[0] + self.heartbeat_s  # as LeaseManager: an interval after this one
        return LeaseChange()


def relay_with(log: Log, clock: list[float]) -> Relay:
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1/db", "bootstrap_servers": "127.0.0.1:9092"})
    relay = Relay(settings, log=log, clock=lambda: clock[0])
    relay.leases = Leases(clock)  # type: ignore[assignment]
    relay.pump = SimpleNamespace(busy_shards=set, rows_in_flight=lambda: 0)  # type: ignore[assignment]
    relay.loop = SimpleNamespace(run_once=lambda now: BatchResult(),  # type: ignore[assignment]
                                 wait=lambda now, wake_by: None, sleeping=False)
    relay.wakeup = SimpleNamespace(moved=False, shards_moved=lambda: False,  # type: ignore[assignment]
                                   close=lambda: None)
    return relay


def late(log: Log) -> list[dict[str, Any]]:
    return [kw for event, kw in log.events if event == "heartbeat_late"]


def test_a_heartbeat_a_whole_interval_late_is_logged_with_how_late() -> None:
    log, clock = Log(), [100.0]
    relay = relay_with(log, clock)
    relay._db_ok()
    relay._tick()  # the first heartbeat: nothing to be late for
    clock[0] += 0.9
    relay._tick()  # not due yet
    clock[0] = 101.5
    relay._tick()  # half an interval late: fine
    assert late(log) == []
    clock[0] = 104.0  # due at 102.5: held up for one and a half seconds
    relay._tick()
    assert late(log) == [{"late_s": 1.5, "lease_duration_s": 3.0}]


def test_no_heartbeat_late_while_the_database_is_away() -> None:
    log, clock = Log(), [100.0]
    relay = relay_with(log, clock)
    relay._db_ok()
    relay._tick()
    relay.db_up = False  # as _db_down leaves it; the retries wait out their back-off
    for _ in range(5):
        clock[0] += 8.0
        relay._tick()
    assert late(log) == []
    relay._db_ok()
    clock[0] += 8.0
    relay._tick()
    assert len(late(log)) == 1


def test_the_first_tick_listens_for_shard_notices_before_its_first_heartbeat() -> None:
    # A peer answers this relay's first heartbeat (its notice that it is below its share)
    # by giving shards back and saying so: this relay must be listening by then.  The
    # CI run of 2026-12-02 16:05 lost that race (an even split after 3.0 s, not 0.1).
    log, clock = Log(), [100.0]
    relay = relay_with(log, clock)
    calls: list[str] = []
    relay.wakeup = SimpleNamespace(moved=False, close=lambda: None,  # type: ignore[assignment]
                                   shards_moved=lambda: calls.append("listen") or False)
    heartbeat = relay.leases.run_once
    relay.leases.run_once = lambda busy: calls.append("heartbeat") or heartbeat(busy)  # type: ignore[method-assign]
    relay._db_ok()
    relay._tick()
    assert calls == ["listen", "heartbeat"]
