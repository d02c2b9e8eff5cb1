"""The relay's view of its dependencies: the database and the Kafka cluster, up or down.

:class:`Dependencies` is a part of :class:`relay.app.Relay`: calls that need the database
are retried until it answers, on its own short back-off (relay/reconnect.py); each change
of state is logged once and shown by the ``database_up`` and ``broker_up`` gauges and by
``/readyz``; the producer's client errors say when every broker is gone, or that the
configuration is wrong (the relay then ends).  A mark connection that broke while the
claims connection still answers is that connection's loss (``mark_connection_lost``), not
the database's (:meth:`Dependencies._mark_connection_lost`); a mark statement the server
cancelled (a ``statement_timeout``) is a slow statement, not an outage either
(:meth:`Dependencies._mark_cancelled`), nor is a claim's (:meth:`Dependencies._statement_cancelled`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from relay.config import mask_text
from relay.errors import DatabaseReadOnly, DatabaseUnavailable, FatalError, StatementCancelled
from relay.mark_cancels import say_cancelled
from relay.marker import LOSS_STREAK_S, MarkCancelled, MarkConnectionLost
from relay.publisher import BrokerState
from relay.wakeup import REOPEN_BACKOFF_MAX_S, REOPEN_BACKOFF_S

if TYPE_CHECKING:
    from relay.config import Settings
    from relay.metrics import RelayMetrics
    from relay.reconnect import Reconnects
    from relay.reopening import CheckedWakeup
    from relay.store import Store


class Dependencies:
    """The database's and the broker's state for :class:`relay.app.Relay`, on its state."""

    #: The last mark failure said, a connection's loss or a cancel (one failed statement fails
    #: each batch it marked: said once).
    _mark_failure_said: DatabaseUnavailable | None = None
    #: Each mark store's committed marks (relay.store.Store.marks) when the database was last
    #: found down: one found broken with no mark committed on it since broke in that outage,
    #: already said (database_unavailable).  Per connection: a flag cleared by the first mark
    #: of any had a second connection broken in the same outage said as its own loss.
    _marks_at_outage: Mapping[Store, int] = MappingProxyType({})  # replaced, never changed

    if TYPE_CHECKING:  # the relay's state and methods (relay/app.py)
        settings: Settings
        mark_stores: list[Store]
        metrics: RelayMetrics
        log: Any
        clock: Callable[[], float]
        _stop: threading.Event
        store: Store
        wakeup: CheckedWakeup
        db_up: bool
        broker_up: bool
        deps_up_at: float
        _reconnects: Reconnects
        _cancels: Reconnects  # the loop's statements cancelled in a row: their back-off
        _db_down_event: str

        @property
        def stopping(self) -> bool: ...
        def _end(self, error: FatalError) -> None: ...

    def _retry_db(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` until the database answers; fatal errors propagate."""
        while not self.stopping:
            try:
                value = call()
                self._db_ok()
                return value
            except DatabaseUnavailable as exc:
                self._db_down(exc)
                self._stop.wait(self._next_wait())
        return None

    def _next_wait(self) -> float:
        return self._reconnects.next_wait_s()

    def _db_ok(self) -> None:
        if not self.db_up:
            failures = self._reconnects.reset()
            if failures:
                self.log.info("database_recovered", after_attempts=failures)
            self.db_up = True
            self.deps_up_at = self.clock()
            self.metrics.database_up.set(1)

    def _broker_ok(self) -> None:
        if not self.broker_up:
            self.broker_up = True
            self.deps_up_at = self.clock()
            self.metrics.broker_up.set(1)
            self.log.info("broker_recovered")

    def _broker_down(self) -> None:
        """No broker answers: /readyz and the gauge say so until :meth:`_broker_ok`."""
        self.broker_up = False
        self.metrics.broker_up.set(0)

    def _db_down(self, exc: Exception) -> None:
        # Logged once per state change; a lost connection that turns out to be a read-only
        # server (failover to a standby) is a change worth its own event.
        event = "database_read_only" if isinstance(exc, DatabaseReadOnly) else "database_unavailable"
        if self.db_up or self._reconnects.failures == 0 or event != self._db_down_event:
            self.log.warning(event, error=str(exc))
            self._db_down_event = event
        self.db_up = False
        self._marks_at_outage = {store: store.marks for store in self.mark_stores}
        self.metrics.database_up.set(0)
        self.store.reset()  # the mark connections reset themselves, on their own threads
        self.wakeup.close()  # the wake-up lock goes with its connection

    def _mark_failed_alone(self, exc: DatabaseUnavailable) -> bool:
        """Whether ``exc`` is a mark's failure alone, not the database's: its statement
        cancelled (:meth:`_mark_cancelled`) or its connection lost while the others answer
        (:meth:`_mark_connection_lost`).  Then it was said, and the caller rewinds (the rows
        of the marks in flight are claimed again); False: an outage, the caller says so."""
        if isinstance(exc, MarkCancelled):
            return self._mark_cancelled(exc)
        return self._mark_connection_lost(exc)

    def _mark_cancelled(self, exc: MarkCancelled) -> bool:
        """A mark statement the server cancelled: a ``statement_timeout`` (the relay's role's,
        its database's, or ``options=-c statement_timeout`` in its DSN) shorter than the mark,
        or an operator's ``pg_cancel_backend``.  The server answered: ``database_up`` stays 1
        and no connection but the mark's is touched.  Before, it took the outage's path
        (``database_unavailable``, the claims and LISTEN connections dropped, a back-off), and
        the line named no setting.  A mark thread marks a cancelled statement's rows again
        itself (relay/mark_cancels.py): one reaches the loop only when a stop ended those
        retries, or when no mark connection marked it.  Said once a statement; always True."""
        if exc is self._mark_failure_said:
            return True
        self._mark_failure_said = exc
        store = next((store for store in (*self.mark_stores, self.store) if store is exc.store), None)
        name = store.name if store is not None else "?"
        say_cancelled(self.log, name, exc, then="its rows are claimed again and published again (a "
                                                 "rewind), nothing is lost")
        return True

    def _statement_cancelled(self, exc: DatabaseUnavailable, statement: str = "other") -> bool:
        """Whether ``exc`` is a statement of the loop's own (a claim, a rewind's sweep, a lease
        heartbeat) the server cancelled while the database was up: a ``statement_timeout``
        shorter than it, a lock on the outbox held longer, a ``pg_cancel_backend``.  The
        server answered: ``database_up`` stays 1 and every connection stays open, the
        cancelled statement's too (relay/store.py keeps a connection a cancel left idle;
        before: the outage's path, ``database_unavailable``, every connection dropped, for a
        slow statement).  Counted by ``statement`` (claim,
        sweep, heartbeat, other: ``outbox_relay_statements_cancelled_total``); said once a
        streak (:meth:`_statement_passed` says its end); the caller waits
        :meth:`_cancelled_wait_s` and tries again."""
        if not isinstance(exc, StatementCancelled) or isinstance(exc, MarkCancelled) or not self.db_up:
            return False
        self.metrics.statements_cancelled.labels(statement).inc()
        if not self._cancels.failures:
            name = self.store.name
            self.log.warning("statement_cancelled", connection=name, statement=statement,
                             error=mask_text(str(exc)),
                             detail=f"the server cancelled a statement of {name} (a claim, a sweep or a "
                                    "lease heartbeat): a statement_timeout shorter than it (set on the "
                                    "relay's role or database, or options=-c statement_timeout in its "
                                    "DSN), a lock on the outbox held longer than it (pg_locks, "
                                    "outbox_relay_lock_wait_seconds), or a pg_cancel_backend. The database "
                                    "answers (database_up stays 1): tried again after a back-off, said "
                                    "once until one passes (statement_recovered). Raise the relay role's "
                                    "statement_timeout above its claims' time "
                                    "(outbox_relay_claim_duration_seconds), or lift it: ALTER ROLE <role> "
                                    "SET statement_timeout = 0")
        return True

    def _cancelled_wait_s(self) -> float:
        """Count a cancelled statement; the seconds to wait before the next try."""
        return self._cancels.next_wait_s()

    def _statement_passed(self) -> None:
        """A turn passed: a streak of cancelled statements ends, said once."""
        if self._cancels.failures:
            self.log.info("statement_recovered", connection=self.store.name,
                          cancelled=self._cancels.reset())

    def _mark_connection_lost(self, exc: DatabaseUnavailable) -> bool:
        """Whether ``exc`` is the loss of one mark connection only: the server ended that
        backend (``pg_terminate_backend``, ``idle_session_timeout``, a pooler dropping it)
        and the claims connection still answers.  Then it is said as such, once, and the
        caller rewinds: whether the marks in flight on it committed is unknown, so their
        rows are claimed again (published again, never lost); the connection re-opens at
        its next mark, after a back-off when it was lost in a row (relay/marker.py
        MarkLosses: counted each time, said once a streak).  Before, it was said ``database_unavailable``, the line of an outage,
        and the claims connection and LISTEN were dropped with it.  False (an outage: the
        caller says so) when the database was already down or does not answer a round trip
        on the claims connection (every backend ended, the server stopped)."""
        if not isinstance(exc, MarkConnectionLost) or not self.db_up:
            return False
        store = next((store for store in self.mark_stores if store is exc.store), None)
        if store is None:  # marked on the claims connection (no mark connection): its loss
            return False
        try:
            self.store.ping()
        except DatabaseUnavailable:
            return False
        if exc is self._mark_failure_said:
            return True
        self._mark_failure_said = exc
        name = store.name
        stale = self._marks_at_outage.get(store) == exc.marks  # none committed on it since the outage
        # Found: it re-opens now, and a later loss is its own.
        self._marks_at_outage = {other: marks for other, marks in self._marks_at_outage.items()
                                 if other is not store}
        if stale:
            self.log.info("mark_connection_stale", connection=name, error=mask_text(str(exc)),
                          detail=f"the mark connection {name} broke in the database's outage "
                                 "(database_unavailable before); its marks in flight are re-claimed "
                                 "(a rewind), and it re-opens at its next mark")
            return True
        # Its own loss: counted each time, said once a streak (relay/marker.py MarkLosses).
        self.metrics.mark_connection_losses.labels(name).inc()
        if store.losses.lost():
            self.log.warning("mark_connection_lost", connection=name, error=mask_text(str(exc)),
                             detail=f"the server ended the mark connection {name} (pg_terminate_backend, "
                                    "idle_session_timeout, a pooler or the network) while the database "
                                    "answers on the others; its marks in flight are re-claimed (a "
                                    "rewind): nothing is lost, those rows may be published twice; it "
                                    "re-opens at its next mark. Lost again within "
                                    f"{LOSS_STREAK_S:g} s, it is counted "
                                    "(outbox_relay_mark_connection_losses_total), not said again, and "
                                    f"its re-open waits a back-off ({REOPEN_BACKOFF_S:g} s doubling up to "
                                    f"{REOPEN_BACKOFF_MAX_S:g} s) while the "
                                    "other mark connections mark")
        return True

    def _client_error(self, state: BrokerState, message: str, fatal: bool) -> None:
        if fatal:
            self._end(FatalError(message))
            return
        if state is BrokerState.UNREACHABLE:
            if self.broker_up:
                self.log.warning("broker_unavailable", error=message)
            self._broker_down()
        elif state is BrokerState.FATAL:
            self.log.error("producer_fatal", error=message)
        else:
            self.log.debug("kafka_client_error", error=message)
