"""The relay's run loop and its shutdown: supervise each turn, drain and give the leases back.

:class:`Running` is a part of :class:`relay.app.Relay` (the composition root, whose module
docstring tells the threads and connections): :meth:`Running.run` starts the parts, turns
the loop until stopped (each turn: the leases and the backlog gauges when due, then one
turn of relay/loop.py and its wait), waits out the database's absences, then drains and
stops every part.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relay.errors import DatabaseUnavailable, RelayError

if TYPE_CHECKING:
    from relay.config import Settings
    from relay.connections import Checks
    from relay.gauges import BacklogGauges
    from relay.http import HealthServer
    from relay.janitor import Janitor
    from relay.leases import LeaseManager
    from relay.loop import Loop
    from relay.metrics import RelayMetrics
    from relay.publisher import Publisher
    from relay.pump import Pump
    from relay.reopening import CheckedWakeup
    from relay.replay import Replayer
    from relay.store import Store
    from relay.waits import WaitWatch

#: How often a busy relay looks for a peer's notice that shards change hands (a
#: non-blocking read of the LISTEN connection; an idle one is woken by it).
SHARDS_LOOK_S = 0.1


class Running:
    """The run loop and the shutdown of :class:`relay.app.Relay`, on its state."""

    if TYPE_CHECKING:  # the relay's state and methods (relay/app.py)
        settings: Settings
        metrics: RelayMetrics
        log: Any
        clock: Callable[[], float]
        _stop: threading.Event
        stopped: threading.Event
        store: Store
        mark_stores: list[Store]
        wakeup: CheckedWakeup
        publisher: Publisher | None
        exactly_once: Any
        pump: Pump | None
        loop: Loop | None
        replayer: Replayer | None
        leases: LeaseManager | None
        http: HealthServer | None
        janitor: Janitor | None
        gauges: BacklogGauges | None
        connections: Checks | None
        waits: WaitWatch
        fatal: RelayError | None
        stop_signal: str | None
        db_up: bool
        last_tick: float
        _next_shards_look: float

        @property
        def stopping(self) -> bool: ...
        def start(self) -> None: ...
        def _db_ok(self) -> None: ...
        def _db_down(self, exc: Exception) -> None: ...
        def _mark_failed_alone(self, exc: DatabaseUnavailable) -> bool: ...
        def _statement_cancelled(self, exc: DatabaseUnavailable, statement: str = "other") -> bool: ...
        def _cancelled_wait_s(self) -> float: ...
        def _statement_passed(self) -> None: ...
        def _broker_ok(self) -> None: ...
        def _next_wait(self) -> float: ...

    #: What :meth:`_tick` runs, for a cancelled statement's label: ``heartbeat`` (the leases),
    #: ``turn`` (the pump's statement, :attr:`relay.pump.Pump.statement`), ``other``.
    _statement = "other"

    def run(self) -> int:
        """Loop until stopped, then drain.  Returns the process exit code."""
        try:
            if self.pump is None and not self.stopping:
                self.start()
            if self.pump is not None:
                self.pump.start()
            if self.janitor is not None:
                self.janitor.start()
            self.waits.start()
            while not self.stopping and self.loop is not None:
                try:
                    if not self.db_up and self.connections and not self.connections.reopened():
                        break  # stopped while waiting for one, after the database went away
                    self._tick()
                    self._db_ok()
                    self._statement_passed()
                except DatabaseUnavailable as exc:
                    if self._mark_failed_alone(exc):  # a mark's connection or statement only
                        self.loop.pump.request_rewind()  # its marks in flight: claimed again
                        continue
                    if self._statement_cancelled(exc, self._cancelled_statement()):  # a slow claim: no outage
                        # A turn cut anywhere.  The rewind publishes nothing twice: it waits until no
                        # row is in flight (Pump._active: produced and unacknowledged, or acknowledged
                        # and unmarked), and then claims only what no mark took.
                        self.loop.pump.request_rewind()
                        self._wait_serving(self._cancelled_wait_s())
                        continue
                    self._db_down(exc)
                    self.loop.database_lost()
                    self._wait_serving(self._next_wait())
            if self.janitor is not None:
                self.janitor.stop(0.0)  # no new cleanup round while draining; joined below
            if self.fatal is not None:
                self._release_quietly()
                raise self.fatal
            self._shutdown()
            return 0
        finally:
            self.waits.stop(5.0)
            if self.pump is not None:
                self.pump.stop(10.0)
            if self.exactly_once is not None:
                self.exactly_once.stop(10.0)
            if self.replayer is not None:
                self.replayer.stop()
            if self.publisher is not None:
                # Whatever the drain left unacknowledged stays pending; the client goes now,
                # its threads joined, not at the interpreter's exit (relay/publisher.py).
                self.publisher.close()
            self.store.close()
            for mark_store in self.mark_stores:
                mark_store.close()
            self.wakeup.close()
            if self.janitor is not None:
                self.janitor.stop(30.0)
            if self.http is not None:
                self.http.stop(5.0)
            self.stopped.set()

    def _cancelled_statement(self) -> str:
        """Which of the loop's statements the server cancelled (the label of
        ``outbox_relay_statements_cancelled_total``): the heartbeat's, or the pump's (a claim,
        a rewind's sweep: relay/pump.py ``statement``), else ``other``."""
        if self._statement == "turn" and self.pump is not None:
            return self.pump.statement
        return self._statement

    def _tick(self) -> None:
        """Supervise (leases and backlog gauges when due), then one turn of the loop."""
        assert self.loop is not None and self.pump is not None and self.leases is not None
        now = self.clock()
        self.last_tick = now
        self._statement = "heartbeat"
        if self.db_up and (self.wakeup.moved or now >= self._next_shards_look):
            # A peer gave shards back or wants some (relay/leases.py): heartbeat now.  Before
            # the heartbeat, so that the first one finds this relay listening already: a
            # peer answering its notice before then would not be heard.
            self._next_shards_look = now + SHARDS_LOOK_S
            if self.wakeup.shards_moved():
                self.leases.hurry()
        if self.leases.due(now):
            due = self.leases.next_due()  # 0 before the first heartbeat: nothing to be late for
            if self.db_up and due and now - due > self.leases.heartbeat_s:
                # The loop thread was held up (CPU starvation, a pause): leases may have
                # expired meanwhile, and the lease_lost that may follow has this cause.
                # (Not while the database is away: retries wait out their back-off, and
                # database_unavailable already said why, once.)
                self.log.warning("heartbeat_late", late_s=round(now - due, 3),
                                 lease_duration_s=self.leases.lease_s)
            change = self.leases.run_once(self.pump.busy_shards())
            if change.acquired or change.released or change.lost:
                self.log.info("leases_changed", acquired=change.acquired, released=change.released,
                              lost=change.lost, held=sorted(self.leases.leases),
                              live_replicas=change.live_replicas)
            if change.acquired:
                self.metrics.leases_acquired.inc(len(change.acquired))
                self.pump.request_rewind()
            self.metrics.leases_held.set(len(self.leases.leases))
        self._statement = "other"
        if self.gauges is not None:
            self.gauges.run_once(now)
        self._statement, self.pump.statement = "turn", "other"
        result = self.loop.run_once(now)
        self._statement = "heartbeat"
        if self.leases.releasing:
            released = self.leases.release_settled(self.pump.busy_shards())
            if released:
                self.log.info("leases_changed", acquired=[], released=released, lost=[],
                              held=sorted(self.leases.leases),
                              live_replicas=self.leases.live_replicas)
                self.metrics.leases_held.set(len(self.leases.leases))
        self._statement = "other"
        if result.acked:
            self._broker_ok()
        if result.marked or result.failed:
            self.log.debug("batch_settled", marked=result.marked, failed=result.failed,
                           fenced=result.fenced, in_flight=self.pump.rows_in_flight())
        self.loop.wait(now, wake_by=min(self.leases.next_due(),
                                        self.gauges.next_at if self.gauges else float("inf")))
        self.metrics.sleeping.set(self.loop.sleeping)

    def _wait_serving(self, seconds: float) -> None:
        """Sleep ``seconds`` (stop-aware) while still serving delivery reports."""
        deadline = self.clock() + seconds
        while not self.stopping and self.clock() < deadline:
            if self.publisher is not None:
                self.publisher.poll(min(0.1, max(0.0, deadline - self.clock())))
            else:
                self._stop.wait(min(0.1, max(0.0, deadline - self.clock())))

    def _shutdown(self) -> None:
        if self.stop_signal is not None:
            self.log.info("signal_received", signal=self.stop_signal)
        if self.pump is None or self.leases is None:
            return
        in_flight = self.pump.rows_in_flight()
        self.log.info("relay_draining", in_flight=in_flight, timeout_s=self.settings.drain_timeout_s)
        try:
            result = self.pump.drain(self.settings.drain_timeout_s)
            released = self.leases.release_all()
            self.log.info("relay_stopped", marked_while_draining=result.marked,
                          left_pending=in_flight - result.acked, released=released,
                          published_total=self.pump.totals.marked)
        except DatabaseUnavailable as exc:
            self.log.warning("relay_stopped_without_marking", error=str(exc),
                             note="unmarked rows stay pending and will be published again")

    def _release_quietly(self) -> None:
        """On a fatal error, give the leases back so a healthy peer takes over at once."""
        if self.leases is not None:
            try:
                self.leases.release_all()
            except RelayError:
                pass  # they expire after one lease duration anyway
