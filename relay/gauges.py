"""The backlog gauges: pending rows, the oldest pending row's age, rows in back-off.

They count every pending row, so what a refresh costs grows with the backlog (70-200 ms
with 300,000 rows held pending by a back-off episode), and with statistics of other times
(a table mostly pending when ANALYZE ran) the count is planned as a scan of the whole
table.  The refresh runs on the loop's thread, between claims, every 5 s
(``Settings.backlog_interval_s``) while it is cheap; one that took T seconds puts the next
one at least ``COST_RATIO`` × T away, so counting never takes more than a twentieth of the
loop's time however large the backlog, and one that took ``SLOW_S`` or more says so
(``backlog_slow``).

Not on a thread and a connection of its own: the relay's connections are counted by the
pools in front of it (README, "Running it as a sidecar"), and in a trial of that design the
extra connection, opened before the first mark, took the last server of a session pool sized
for the relay's documented connections, and the relay stopped marking
(tests/integration/test_pgbouncer.py failed 4 of 4).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from relay.errors import StatementCancelled

COST_RATIO = 20.0  # a refresh that took T waits at least COST_RATIO * T for the next
CANCELLED_WAIT_S = 60.0  # a count the server cancelled is tried again no sooner
SLOW_S = 0.5  # a refresh this slow is logged, with when the next one runs

Publish = Callable[[int, float, int], None]  # pending rows, oldest pending age (s), in back-off


class BacklogGauges:
    def __init__(self, store: Any, *, interval_s: float, publish: Publish, log: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.interval_s = interval_s
        self.publish = publish
        self.log = log
        self.clock = clock
        self.next_at = float("-inf")  # the first turn refreshes

    def run_once(self, now: float) -> None:
        """Refresh when due.  The store's errors propagate (the loop waits them out), and
        a refresh that failed is tried again at the next turn; but a count the server
        cancelled (a statement_timeout set on the relay's role, shorter than the count of a
        large backlog) is skipped: retried first at every turn, it kept the relay from ever
        claiming again, the gauges at 0 (an audit of the relay's operation)."""
        if now < self.next_at:
            return
        try:
            took = self.refresh()
        except StatementCancelled as exc:
            took = self.clock() - now
            self.next_at = self.clock() + max(CANCELLED_WAIT_S, COST_RATIO * took)
            if self.log is not None:
                self.log.warning("backlog_count_cancelled", error=str(exc), next_refresh_in_s=round(self.next_at - self.clock(), 1),
                                 hint="the server cancelled the count of pending rows (a statement_timeout on the "
                                      "relay's role?); the backlog gauges keep their last figures. Publishing goes on")
            return
        wait_s = self.next_wait(took)
        self.next_at = self.clock() + wait_s
        if took >= SLOW_S and self.log is not None:
            self.log.warning("backlog_slow", seconds=round(took, 3), next_refresh_in_s=round(wait_s, 1))

    def refresh(self) -> float:
        """Count once and publish the figures; returns how long the count took (seconds)."""
        started = self.clock()
        pending, oldest_age_s, retrying = self.store.backlog()
        self.publish(pending, oldest_age_s, retrying)
        return self.clock() - started

    def next_wait(self, took_s: float) -> float:
        """How long to wait after a refresh that took ``took_s``."""
        return max(self.interval_s, COST_RATIO * took_s)
