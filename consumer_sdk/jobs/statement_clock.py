"""How long the pool's own statements waited: a statement_timeout told in any language.

PostgreSQL cancels a statement with the same SQLSTATE (57014) and the same reporting
routine for its ``statement_timeout`` and for a cancel request (``pg_cancel_backend``, a
client's cancel); only the message, in the server's ``lc_messages``, tells them apart, and
under another language :func:`consumer_sdk.jobs._db.translated` read the pool's own
timeouts as "database unavailable".  On the pool's own sessions the pool set the timeout
itself (``pool_statement_timeout_s``, :class:`~consumer_sdk.jobs._conn.ConnSlot`), so the
client can tell it by its own clock: a 57014 that ends a wait for the server at least that
long (monotonic, client-measured: from before the statement was sent, so not shorter than
the server's count; a statement an earlier wait sent, in psycopg's pipeline mode, reads
shorter and keeps the English sign only) less :data:`MARGIN_S` is the timeout's, whatever the
words.  A cancel
request sent earlier is not; one that lands in the last margin reads as the timeout, which
was about to cancel the statement anyway.

The measure: every wait for the server (psycopg's ``Connection.wait``, the one path its
statements, commits and pipelines all take) of a :class:`TimedWaits` connection whose
``statement_timeout_s`` the pool set is recorded for the thread that waited (:func:`last_wait`);
a wait on another of the pool's connections (a handler's: not timed, the hot path) clears the
record.  psycopg is synchronous: the error a wait's results carry is raised on that thread
right after it, before any other wait, so ``translated`` reads the record of the wait that
failed; a record older than
:data:`FRESH_S` is not read (a later error on another kind of connection, not recorded, is
not that wait's).  A connection of the caller's ``connect=`` factory is not a TimedWaits:
there, as on the callers' own sessions, only the English words tell the timeout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg

#: A wait this much shorter than the timeout still counts as the timeout's (the server's
#: timer and the client's clock are not the same clock).
MARGIN_S = 0.01
#: A record read later than this after its wait ended belongs to no error being raised now.
FRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class Wait:
    """One wait for the server on one of the pool's own sessions: its length, when it ended
    (monotonic), and the session's statement_timeout."""

    waited_s: float
    ended: float
    timeout_s: float


class _LastWait(threading.local):
    wait: Wait | None = None


_last = _LastWait()


def last_wait() -> Wait | None:
    """This thread's last recorded wait, if any."""
    return _last.wait


def timed_out() -> bool:
    """The last wait of this thread, just ended, was on a session of the pool's own timeout
    and lasted that timeout: the 57014 being raised is that timeout's."""
    wait = _last.wait
    if wait is None or time.monotonic() - wait.ended > FRESH_S:
        return False
    return wait.waited_s >= wait.timeout_s - min(MARGIN_S, wait.timeout_s / 2)


class TimedWaits(psycopg.Connection[Any]):
    """A connection whose waits for the server are recorded (see the module).  The pool's
    :class:`~consumer_sdk.jobs._conn.ConnSlot` sets :attr:`statement_timeout_s` when it sets
    the session's statement_timeout."""

    #: The session's statement_timeout set by the pool (seconds); None: not the pool's own.
    statement_timeout_s: float | None = None

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        timeout_s = self.statement_timeout_s
        if timeout_s is None:  # not the pool's own session (a handler's: the hot path): not timed
            _last.wait = None
            return super().wait(*args, **kwargs)
        began = self.clock()
        try:
            return super().wait(*args, **kwargs)
        finally:
            ended = self.clock()
            _last.wait = Wait(ended - began, ended, timeout_s)

    def clock(self) -> float:
        """Monotonic seconds (tests stub it)."""
        return time.monotonic()
