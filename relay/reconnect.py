"""How long the relay waits before it tries a database that went away again.

Its own back-off, not the publish retries' (``--backoff-initial-s`` / ``--backoff-max-s``,
for rows the broker refused): a database that restarts or fails over is back within
seconds, and writers reconnect within about one.  On the publish back-off (capped at
30 s) the relay came back 15 to 27 s after the new primary (an audit with a real
standby).  So: 0.5 s, doubling, capped at 2 s, with jitter (replicas that lost the
database together do not come back together); never longer than ``--backoff-max-s``
either, for a deployment that lowered it to reconnect sooner still.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from outbox_core.backoff import backoff_s

#: The first wait after the database went away, seconds.
DB_RECONNECT_INITIAL_S = 0.5
#: The longest wait between two attempts to reach the database, seconds.
DB_RECONNECT_MAX_S = 2.0


class Reconnects:
    """The database's failures in a row and the wait after each.  Owned by the loop's thread."""

    def __init__(self, *, cap_s: float = DB_RECONNECT_MAX_S,
                 rand: Callable[[], float] = random.random) -> None:
        """``cap_s``: the caller's own cap (``--backoff-max-s``), when lower than
        :data:`DB_RECONNECT_MAX_S`."""
        self.max_s = min(DB_RECONNECT_MAX_S, cap_s)
        self.initial_s = min(DB_RECONNECT_INITIAL_S, self.max_s)
        self.failures = 0  # in a row, since the database last answered
        self._rand = rand

    def next_wait_s(self) -> float:
        """Count one more failure; the seconds to wait before the next attempt."""
        self.failures += 1
        return backoff_s(self.failures, initial_s=self.initial_s, max_s=self.max_s, rand=self._rand)

    def reset(self) -> int:
        """The database answered: start again from the first wait.  Returns the failures
        there were."""
        failures, self.failures = self.failures, 0
        return failures
