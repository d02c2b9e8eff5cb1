"""The relay's view of its dependencies: the database and the Kafka cluster, up or down.

:class:`Dependencies` is a part of :class:`relay.app.Relay`: calls that need the database
are retried until it answers, on its own short back-off (relay/reconnect.py); each change
of state is logged once and shown by the ``database_up`` and ``broker_up`` gauges and by
``/readyz``; the producer's client errors say when every broker is gone, or that the
configuration is wrong (the relay then ends).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relay.errors import DatabaseReadOnly, DatabaseUnavailable, FatalError
from relay.publisher import BrokerState

if TYPE_CHECKING:
    from relay.metrics import RelayMetrics
    from relay.reconnect import Reconnects
    from relay.reopening import CheckedWakeup
    from relay.store import Store


class Dependencies:
    """The database's and the broker's state for :class:`relay.app.Relay`, on its state."""

    if TYPE_CHECKING:  # the relay's state and methods (relay/app.py)
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
        self.metrics.database_up.set(0)
        self.store.reset()  # the mark connections reset themselves, on their own threads
        self.wakeup.close()  # the wake-up lock goes with its connection

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
