"""/healthz with the wait watch (relay/probes.py, relay/waits.py): a loop whose statement the
server says waits on a lock is alive; a loop that does not tick with nothing on the server
(wedged) still fails, and so does one whose wait is on another of its connections."""

from __future__ import annotations

from types import SimpleNamespace

import structlog

from relay.app import Relay, application_name
from relay.config import build_settings
from relay.waits import Blocker, Waiting, WaitWatch, waiting_from_row


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def relay_at(clock: Clock) -> Relay:
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1/db", "owner": "r1",
                               "bootstrap_servers": "127.0.0.1:9092"})
    relay = Relay(settings, log=structlog.get_logger(), clock=clock)
    relay.pump = SimpleNamespace(last_marked_at=clock.now, busy=lambda: False, marks_cancelled=lambda: False)  # type: ignore[assignment]
    relay._db_ok()
    return relay


def lock_wait(connection: str, running_s: float = 40.0) -> Waiting:
    return Waiting(pid=7, connection=connection, running_s=running_s, wait_event_type="Lock",
                   wait_event="relation", relation="outbox", mode="RowExclusiveLock",
                   blockers=(Blocker(pid=9, application_name="psql", state="idle in transaction",
                                     query="LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE"),))


def seen(relay: Relay, clock: Clock, *waits: Waiting) -> None:
    """What the watch's last look found, as its thread would have set it."""
    relay.waits._waits, relay.waits._looked_at = waits, clock.now


def test_a_loop_waiting_on_a_lock_the_server_confirms_stays_live() -> None:
    clock = Clock()
    relay = relay_at(clock)
    clock.now += 40  # the loop has not ticked for 40 s
    seen(relay, clock, lock_wait(application_name("r1", "")))
    ok, body = relay.health()
    assert ok
    assert body["database_waits"] == ["outbox-relay:r1 waiting on a lock on outbox for 40 s, held by pid 9 "
                                      "(psql, idle in transaction): LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE"]


def test_a_wedged_loop_still_fails_with_nothing_or_another_connection_waiting() -> None:
    clock = Clock()
    relay = relay_at(clock)
    clock.now += 40
    assert not relay.health()[0]  # nothing on the server: wedged
    seen(relay, clock, lock_wait(application_name("r1", ":mark")))
    assert not relay.health()[0]  # a mark waits, the loop does not tick for its own reasons


def test_a_look_too_old_to_trust_confirms_nothing() -> None:
    clock = Clock()
    relay = relay_at(clock)
    clock.now += 40
    seen(relay, clock, lock_wait(application_name("r1", "")))
    clock.now += 3 * relay.waits.every_s + 1  # the watch's thread stopped looking
    assert not relay.health()[0]


def test_the_watch_looks_only_while_the_relay_is_held_up() -> None:
    held = [0.0]
    gauge: list[float] = []
    watch = WaitWatch("postgresql://u@127.0.0.1:1/db", application_name="x", names=["a"],
                      held_up_s=lambda: held[0], on_lock_wait_s=gauge.append, log=structlog.get_logger())
    looks: list[int] = []
    watch._look = lambda: (looks.append(1), (lock_wait("a", 12.0),))[1]  # type: ignore[method-assign]
    assert watch.run_once() == () and looks == []
    held[0] = 6.0
    assert watch.run_once()[0].relation == "outbox" and gauge == [12.0]
    held[0] = 0.0
    assert watch.run_once() == () and gauge == [12.0, 0.0]


def test_a_blocking_query_is_cut_and_its_secrets_masked() -> None:
    row = (5, "outbox-relay:r1", 7.5, "Lock", "relation", "outbox", "AccessShareLock",
           [{"pid": 9, "application_name": None, "state": "active",
             "query": "SELECT dblink('postgresql://admin:hunter2@db/x', 'VACUUM FULL outbox')"}])
    waiting = waiting_from_row(row)
    assert "hunter2" not in waiting.describe() and "no application_name" in waiting.describe()
    assert len(waiting.blockers[0].query) <= 80


def test_a_blocker_the_relays_role_may_not_see_is_still_named_by_pid_and_application_name() -> None:
    row = (5, "outbox-relay:r1", 7.5, "Lock", "relation", "outbox", "AccessShareLock",
           [{"pid": 9, "application_name": "dba-x", "state": None, "query": "<insufficient privilege>"}])
    assert waiting_from_row(row).describe() == ("outbox-relay:r1 waiting on a lock on outbox for 8 s, "
                                                "held by pid 9 (dba-x): <insufficient privilege>")
