"""The LISTEN connection re-opened at run time (relay/reopening.py, CheckedWakeup): on a
thread of its own, checked and named as at start, while the loop's thread goes on: its calls
(shards_moved, set_sleeping, wait) never wait for the re-open, the loop claims at its poll
interval meanwhile (relay/loop.py), and adopts the connection, its LISTEN statements run,
once it is ready.  A stop, or the database going away, abandons the attempt: what it opens
later is closed.  The replays' connection re-opens on a thread of its own too (ReopeningReplayer).  Pure logic: the driver's connect is faked (a pooler's queue is a first
statement that waits); the real PgBouncer case is tests/integration/test_pgbouncer_reconnect.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from relay import wakeup as wakeup_module
from relay.connections import LISTEN, Checks, Needed
from relay.errors import AuthenticationFailed, DatabaseUnavailable
from relay.loop import Loop
from relay.metrics import RelayMetrics
from relay.pump import Pump
from relay.queries import query
from relay.reopening import CheckedWakeup, ReopeningReplayer
from relay.wakeup import LISTEN_STATEMENTS
from tests.fixtures.procs import wait_until
from tests.unit.pump_fakes import Clock, FailingPublisher, LosingLeases, RetryStore, row
from tests.unit.pump_fakes import Log as FakeLog
from tests.unit.pump_fakes import Wakeup as FakeWakeup
from tests.unit.test_connections import Log

POLL_S = 1.0


class Listen:
    """A LISTEN connection whose first statement waits for ``served`` (a pooler's queue)."""

    def __init__(self, served: threading.Event) -> None:
        self.served = served
        self.closed = False
        self.statements: list[str] = []

    def execute(self, statement: Any, *_args: Any) -> Listen:
        if not self.statements:
            assert self.served.wait(10), "never served"
        self.statements.append(str(statement))
        return self

    def fetchone(self) -> tuple[bool, bool]:
        return True, False  # go_to_sleep: the lock taken, no peer holds it

    def notifies(self, timeout: float = 0) -> Iterator[Any]:
        return iter(())

    def close(self) -> None:
        self.closed = True


class Connects:
    """The connections opened, each waiting at its first statement for ``served``."""

    def __init__(self) -> None:
        self.served = threading.Event()
        self.opened: list[Listen] = []
        self.error: Exception | None = None

    def __call__(self, *_args: Any, **_kwargs: Any) -> Listen:
        if self.error is not None:
            raise self.error
        conn = Listen(self.served)
        self.opened.append(conn)
        return conn


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> Connects:
    fake = Connects()
    monkeypatch.setattr(wakeup_module, "connect", fake)
    monkeypatch.setattr("relay.connections.CONNECTION_WAIT_S", 0.05)
    return fake


def _listening(connects: Connects, log: Log, stopping: threading.Event,
               now: list[float]) -> tuple[CheckedWakeup, Listen]:
    """A CheckedWakeup opened by the start's check, then checked on re-open; its connection broke."""
    wakeup = CheckedWakeup("dbname=x", clock=lambda: now[0])
    connects.served.set()
    wakeup.ping()  # the start's check: on the caller's thread
    first = connects.opened[-1]
    Checks([Needed("relay", "claims and leases", lambda: None, recheck=True), Needed(*LISTEN, wakeup.ping)],
           log=log, stopping=stopping.is_set).check_reopens(wakeup)
    connects.served.clear()  # no server free from now on
    first.closed = True  # the server session ended
    return wakeup, first


def test_the_loops_calls_never_wait_for_listens_reopen_and_adopt_it_once_ready(connects: Connects) -> None:
    log, stopping, now = Log(), threading.Event(), [100.0]
    wakeup, _first = _listening(connects, log, stopping, now)
    queries = wakeup.queries
    assert wakeup.shards_moved() is False  # starts the re-open on its thread, reads no notice
    assert log.warned.wait(10)  # named as at start, while the loop's calls go on
    assert wakeup.set_sleeping(True) is False and wakeup.not_listening and not wakeup.sleeping
    assert wakeup.wait(0.01) is False and wakeup.shards_moved() is False
    assert len(connects.opened) == 2  # one attempt, not one per call
    event, fields = log.events[0]
    assert event == "database_connection_waiting" and fields["connection"] == LISTEN[0], fields
    assert fields["reopened"] is True and str(fields["detail"]).startswith(
        "could not get connection 2 of 2 (outbox-relay-listen: LISTEN and the wake-up lock) within"), fields
    connects.served.set()  # a server came free: the loop's next call adopts the connection
    wait_until(lambda: wakeup.set_sleeping(True), timeout_s=10, message="the re-opened connection was not adopted")
    assert wakeup.sleeping and not wakeup.not_listening
    # Its LISTEN statements ran before it was adopted, then the lock was taken on it.
    assert connects.opened[1].statements == [str(query("relay", name))
                                             for name in (*LISTEN_STATEMENTS, "go_to_sleep")]
    assert wakeup.queries == queries + 4
    wait_until(lambda: [each for each, _ in log.events] == ["database_connection_waiting",
                                                           "database_connection_ready"],
               timeout_s=10, message=lambda: f"not said ready: {log.events}")


def test_a_stop_or_a_close_abandons_the_reopen_and_what_it_opens_is_closed(connects: Connects) -> None:
    log, stopping, now = Log(), threading.Event(), [100.0]
    wakeup, _first = _listening(connects, log, stopping, now)
    assert wakeup.set_sleeping(True) is False
    assert log.warned.wait(10)
    wakeup.close()  # the database went away, or the relay stops
    connects.served.set()  # the abandoned attempt's server comes
    opened = connects.opened[1]
    wait_until(lambda: opened.closed, timeout_s=10, message="the abandoned connection was not closed")
    # A new attempt: the abandoned one is never adopted.
    wait_until(lambda: wakeup.set_sleeping(True), timeout_s=10, message="the new attempt was not adopted")
    assert len(connects.opened) == 3 and connects.opened[2].statements and not connects.opened[2].closed
    # A stop ends an attempt's wait: the thread gives up, nothing is adopted.
    wakeup.close()
    connects.served.clear()
    assert wakeup.set_sleeping(True) is False
    wait_until(lambda: len(connects.opened) == 4, timeout_s=10, message="no attempt")
    waiting = connects.opened[3]
    stopping.set()
    wait_until(lambda: not [t for t in threading.enumerate() if t.name == "outbox-relay-listen-reopen"],
               timeout_s=5, message="the re-open's thread did not end on the stop")
    connects.served.set()
    wait_until(lambda: waiting.closed, timeout_s=10, message="the connection that came after the stop was kept")


def test_a_failed_reopen_is_tried_again_after_a_back_off_and_a_fatal_one_is_raised(connects: Connects) -> None:
    log, stopping, now = Log(), threading.Event(), [100.0]
    wakeup, _first = _listening(connects, log, stopping, now)
    connects.error = DatabaseUnavailable("database unreachable")
    assert wakeup.set_sleeping(True) is False
    # The attempt failed on its thread: the loop's next call reads it, and backs off.
    wait_until(lambda: wakeup.set_sleeping(True) is False and wakeup._opening is None, timeout_s=10,
               message="the failed attempt was not read")
    connects.error = None
    now[0] += 0.5
    assert wakeup.set_sleeping(True) is False and wakeup._opening is None  # within the back-off: no attempt
    now[0] += 1.0
    connects.served.set()
    wait_until(lambda: wakeup.set_sleeping(True), timeout_s=10, message="not re-opened after the back-off")
    wakeup.close()
    connects.error = AuthenticationFailed("password authentication failed")
    with pytest.raises(AuthenticationFailed):  # ends the relay, as it did on the loop's thread
        wait_until(lambda: wakeup.set_sleeping(True), timeout_s=10, message="the failure was not raised")


class NoListen(FakeWakeup):
    """The wake-up adapter while its LISTEN connection is re-opened: the lock is refused for
    want of a connection (``not_listening``), and nothing notifies this relay."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock, grant=False, peer=False)
        self.not_listening = False

    def set_sleeping(self, sleeping: bool) -> bool:
        self.not_listening = sleeping
        return super().set_sleeping(sleeping)


def test_without_its_listen_connection_an_idle_relay_claims_once_per_poll_interval() -> None:
    # Paced as the relay's defaults pace claims.  It cannot sleep, and no writer notifies it:
    # its poll finds the rows, once per poll interval (not at its pace: 12 claims a second).
    clock = Clock()
    store = RetryStore([], clock)  # type: ignore[arg-type]
    publisher = FailingPublisher(clock, None)
    leases = LosingLeases()
    wakeup = NoListen(clock)
    pump = Pump(store=store, publisher=publisher, leases=leases, nshards=2, batch_size=10,  # type: ignore[arg-type]
                pipeline_depth=2, max_attempts=3, backoff_initial_s=0.1, backoff_max_s=1.0,
                metrics=RelayMetrics(), log=FakeLog(), clock=clock, claim_interval_s=0.005,
                claim_interval_max_s=0.08)
    loop = Loop(pump=pump, wakeup=wakeup, leases=leases, poll_interval_s=POLL_S, clock=clock)  # type: ignore[arg-type]
    pump.start()

    def turn_until(done: Any) -> None:
        for _ in range(10_000):
            if done():
                return
            now = clock()
            loop.run_once(now)
            loop.wait(now, wake_by=now + 60.0)
        raise AssertionError("never")

    turn_until(lambda: clock() >= 1002.0)
    assert wakeup.not_listening
    claims, start = store.claims, clock()
    turn_until(lambda: clock() - start >= 10 * POLL_S)
    assert 9 <= store.claims - claims <= 11
    store.add(row(1, 0))  # a writer's commit: found by the next poll
    written = clock()
    turn_until(lambda: publisher.sent_at)
    assert publisher.sent_at[0][1] - written <= POLL_S + 1e-6


class Replays:
    """The replayer: its statements fail while ``broken``; counts its turns."""

    def __init__(self) -> None:
        self.broken = False
        self.turns = 0

    def run_once(self, _leases: Any) -> str:
        self.turns += 1
        if self.broken:
            raise DatabaseUnavailable("database connection lost")
        return "replayed"

    def busy(self) -> bool:
        return True

    def wait(self, _timeout_s: float) -> None: ...


class ReplayStore:
    """The replays' store: its re-open (ping) waits for ``served``, or fails with ``error``."""

    def __init__(self) -> None:
        self.served = threading.Event()
        self.error: Exception | None = None
        self.closed = self.pings = 0

    def close(self) -> None:
        self.closed += 1

    def ping(self) -> None:
        self.pings += 1
        assert self.served.wait(10), "never served"
        if self.error is not None:
            raise self.error


def test_a_broken_replay_connection_reopens_on_its_own_thread_and_replays_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("relay.connections.CONNECTION_WAIT_S", 0.05)
    log, stopping, now = Log(), threading.Event(), [100.0]
    replays, store = Replays(), ReplayStore()
    replaying = ReopeningReplayer(replays, store, name="relay:replay", clock=lambda: now[0])
    with pytest.raises(DatabaseUnavailable):  # before the start's check: as before, the loop's error
        replays.broken = True
        replaying.run_once([])
    Checks([Needed("relay", "claims and leases", lambda: None, recheck=True),
            Needed("relay:replay", "replays", store.ping)], log=log, stopping=stopping.is_set
           ).check_reopens(replaying)
    assert replaying.run_once([]) is None and store.closed == 1  # not the database down: re-opened
    replays.broken = False
    turns = replays.turns
    assert replaying.run_once([]) is None  # starts the re-open on its thread, which waits
    assert log.warned.wait(10)
    assert replaying.run_once([]) is None and not replaying.busy() and replays.turns == turns
    fields = log.events[0][1]
    assert fields["connection"] == "relay:replay" and fields["reopened"] is True, fields
    store.served.set()
    wait_until(lambda: replaying.run_once([]) == "replayed", timeout_s=10, message="replays did not resume")
    assert replaying.busy() and store.pings == 1
    # A re-open that failed is tried again after the back-off; a fatal failure ends the relay.
    replays.broken, store.error = True, DatabaseUnavailable("database unreachable")
    assert replaying.run_once([]) is None
    wait_until(lambda: replaying.run_once([]) is None and replaying._reopening is None and store.pings == 2,
               timeout_s=10, message="the failed re-open was not read")
    assert replaying.run_once([]) is None and store.pings == 2  # within the back-off
    now[0] += 1.0
    store.error = AuthenticationFailed("password authentication failed")
    with pytest.raises(AuthenticationFailed):
        wait_until(lambda: replaying.run_once([]), timeout_s=10, message="the failure was not raised")


def test_a_listen_reopen_that_keeps_failing_is_said_once_a_streak(connects: Connects) -> None:
    # The re-open runs on a thread of its own and the loop polls meanwhile: without a word, a
    # LISTEN refused for good (a role's connection limit, a standby) left a relay that only
    # polled, and nobody knew why it no longer slept.
    log, stopping, now = Log(), threading.Event(), [100.0]
    wakeup, _first = _listening(connects, log, stopping, now)
    connects.error = DatabaseUnavailable("database unavailable: too many connections for role")
    for _ in range(3):  # three attempts, each after its back-off
        wait_until(lambda: wakeup.set_sleeping(True) is False and wakeup._opening is None
                   and any(e == "listen_reopen_failed" for e, _ in log.events),
                   timeout_s=10, message=lambda: f"the failure was not read: {log.events}")
        now[0] += 60.0
    failed = [fields for event, fields in log.events if event == "listen_reopen_failed"]
    assert len(failed) == 1 and len(connects.opened) == 1, (failed, connects.opened)
    assert failed[0]["error"] == "database unavailable: too many connections for role"
    assert "claims every --poll-interval-s" in str(failed[0]["detail"])
    assert not [fields for event, fields in log.events if event == "listen_reopened"]
    connects.error = None
    connects.served.set()
    wait_until(lambda: wakeup.set_sleeping(True), timeout_s=10, message="not re-opened")
    # The streak's end is said too, as the replays' is: an SRE alerted by the failure sees
    # LISTEN back (before, nothing said so).
    (reopened,) = [fields for event, fields in log.events if event == "listen_reopened"]
    assert reopened["connection"] == LISTEN[0] and reopened["failures"] == 3, reopened
    assert "3 failed re-opens" in str(reopened["detail"]), reopened
    assert failed[0]["connection"] == LISTEN[0], failed
    wakeup.close()  # it broke again: a new streak is said again
    connects.error = DatabaseUnavailable("database unavailable: the server closed the connection")
    now[0] += 60.0
    wait_until(lambda: wakeup.set_sleeping(True) is False
               and sum(e == "listen_reopen_failed" for e, _ in log.events) == 2,
               timeout_s=10, message=lambda: f"a new streak was not said: {log.events}")
    connects.error = None
    now[0] += 60.0
    wait_until(lambda: wakeup.set_sleeping(True), timeout_s=10, message="not re-opened after the second streak")
    first, second = [fields for event, fields in log.events if event == "listen_reopened"]
    assert second["failures"] == 1, second
