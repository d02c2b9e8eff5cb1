"""One lifecycle for every long-lived part of the relay: ``start()``, then ``stop(timeout_s)``
that may be called again (and before ``start``) without effect; what runs a thread has
none left after ``stop``.  (The mark thread: tests/unit/test_marker.py; the exactly-once
publisher: tests/unit/test_exactly_once_publisher.py.)"""

from __future__ import annotations

import socket
import threading
from typing import Any

from prometheus_client import CollectorRegistry

from relay.http import HealthServer
from relay.janitor import Janitor
from relay.metrics import RelayMetrics
from relay.pump import Pump
from relay.replay import Replayer
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row


def _threads(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name == name and t.is_alive())


class CleanupStore:
    def __init__(self) -> None:
        self.rounds = threading.Event()
        self.closed = 0

    def cleanup_batch(self, *, retention_s: float, limit: int, after: Any = None) -> tuple[int, Any]:
        self.rounds.set()
        return 0, None

    def reset(self) -> None: ...

    def close(self) -> None:
        self.closed += 1


def test_the_janitor_runs_rounds_on_its_thread_until_stopped_once() -> None:
    store = CleanupStore()
    janitor = Janitor(store, retention_s=60, batch=10, interval_s=30)
    janitor.start()
    janitor.start()  # one thread
    assert store.rounds.wait(10)
    assert _threads("outbox-relay-janitor") == 1
    janitor.stop(5.0)  # wakes it from its 30 s pause at once
    janitor.stop(5.0)
    assert _threads("outbox-relay-janitor") == 0
    assert store.closed == 1
    janitor.start()  # a stopped janitor stays stopped
    assert _threads("outbox-relay-janitor") == 0


class GatedCleanupStore(CleanupStore):
    """A round that runs until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.calls = 0

    def cleanup_batch(self, *, retention_s: float, limit: int, after: Any = None) -> tuple[int, Any]:
        self.calls += 1
        self.rounds.set()
        assert self.gate.wait(10)
        return 0, None


def test_stop_without_waiting_lets_the_round_finish_then_the_thread_closes_its_connection() -> None:
    store = GatedCleanupStore()
    janitor = Janitor(store, retention_s=60, batch=10, interval_s=0)
    janitor.start()
    assert store.rounds.wait(10)  # a round is under way
    janitor.stop(0.0)  # the relay's loop has ended: only ask (the drain is not held up)
    assert _threads("outbox-relay-janitor") == 1 and store.closed == 0
    store.gate.set()
    janitor.stop(5.0)  # the relay's teardown: wait for it
    assert _threads("outbox-relay-janitor") == 0
    assert store.closed == 1 and store.calls == 1  # no round after the stop


class FailingCleanupStore(CleanupStore):
    """Its first rounds fail with an error no handler named."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def cleanup_batch(self, *, retention_s: float, limit: int, after: Any = None) -> tuple[int, Any]:
        self.calls += 1
        if self.calls <= 2:
            raise ValueError("something no handler named")
        return super().cleanup_batch(retention_s=retention_s, limit=limit, after=after)


def test_a_round_that_fails_unexpectedly_does_not_end_the_janitor() -> None:
    # The thread ended with a traceback (a partition-creation race raised DuplicateTable):
    # retention and partition maintenance stopped for good while the relay said it was healthy.
    store, events = FailingCleanupStore(), []

    class Log:
        def error(self, event: str, **kw: Any) -> None:
            events.append((event, kw))

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    janitor = Janitor(store, retention_s=60, batch=10, interval_s=0.01, log=Log())
    janitor.start()
    assert store.rounds.wait(10)  # the third round came
    janitor.stop(5.0)
    assert [e for e, _ in events[:2]] == ["cleanup_failed"] * 2
    assert "ValueError: something no handler named" in events[0][1]["error"]


def test_a_janitor_never_started_stops_and_closes_its_connection() -> None:
    store = CleanupStore()
    janitor = Janitor(store, retention_s=None, batch=10, interval_s=1)
    janitor.stop(1.0)
    janitor.stop(1.0)
    assert store.closed == 1 and not store.rounds.is_set()


def test_the_pump_starts_and_stops_its_mark_thread_once() -> None:
    store, mark_store = Store([row(1, 0)]), Store([])
    pump = Pump(store=store, publisher=Publisher(), leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=10, pipeline_depth=1, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), mark_store=mark_store)
    before = _threads("outbox-relay-mark")
    pump.start()
    pump.start()
    assert _threads("outbox-relay-mark") == before + 1
    mark_store.pending = store.pending  # one database behind both connections
    pump.run_once()  # claims row 1
    pump.run_once()  # acknowledged: marked on the mark thread
    pump.stop(5.0)  # after the marks already submitted
    pump.stop(5.0)
    assert _threads("outbox-relay-mark") == before
    assert mark_store.marked == [1]


def test_the_health_server_stops_once() -> None:
    server = HealthServer(host="127.0.0.1", port=0, registry=CollectorRegistry(),
                          health=lambda: (True, {}), ready=lambda: (True, {}))
    server.start()
    server.start()
    assert _threads("outbox-relay-http") == 1
    server.stop(5.0)
    server.stop(5.0)
    assert _threads("outbox-relay-http") == 0


def test_the_health_server_answers_when_its_loop_is_turned_by_hand() -> None:
    server = HealthServer(host="127.0.0.1", port=0, registry=CollectorRegistry(),
                          health=lambda: (False, {"why": "test"}), ready=lambda: (True, {}))
    try:
        client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        for _ in range(20):  # accept, read the request, write the answer: a few rounds
            assert server.run_once(timeout_s=0.05)
            client.setblocking(False)
            try:
                answer += client.recv(4096)
            except BlockingIOError:
                pass
            if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                break
        client.close()
        assert answer.startswith(b"HTTP/1.1 503") and b'"why": "test"' in answer
    finally:
        server.stop(1.0)
    assert not server.run_once(timeout_s=0.01)  # stopped: the loop ends


class ReplayStore:
    def __init__(self) -> None:
        self.closed = 0
        self.looked = 0

    def active_replays(self) -> list[dict[str, Any]]:
        self.looked += 1
        return []

    def close(self) -> None:
        self.closed += 1


def test_the_replayer_stops_once_and_does_nothing_after() -> None:
    store = ReplayStore()
    replayer = Replayer(store, Publisher(), owner="me", nshards=2,  # type: ignore[arg-type]
                        metrics=RelayMetrics(), log=Log())
    replayer.start()
    replayer.run_once([])
    assert store.looked == 1
    replayer.stop(1.0)
    replayer.stop(1.0)
    assert store.closed == 1
    replayer.run_once([])
    assert store.looked == 1  # stopped: no more statements


def test_a_relay_stopped_before_it_runs_starts_nothing_and_stops_once() -> None:
    from relay.app import Relay
    from relay.config import build_settings

    settings = build_settings({"dsn": "postgresql://u@127.0.0.1:1/db",
                               "bootstrap_servers": "127.0.0.1:1"})
    relay = Relay(settings, log=Log())
    relay.stop()
    relay.stop()
    assert relay.run() == 0  # nothing connected: the DSN's port is closed
    assert relay.stopped.is_set() and relay.pump is None and relay.loop is None
    relay.stop(1.0)  # returns at once: run has finished
