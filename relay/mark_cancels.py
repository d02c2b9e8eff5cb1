"""A mark statement the server cancelled is marked again, not claimed and published again.

57014 (a ``statement_timeout`` shorter than the mark, a lock on outbox rows held longer
than it, an operator's ``pg_cancel_backend``): the database answers and nothing of the
statement committed (unlike a lost connection's, whose outcome is unknown).  Before, the
loop rewound: every row of the marks in flight was claimed and published again, and again
at each cancel of a streak (a flood of duplicates while a lock or a slow server lasted).
Now the mark thread (relay/marker.py ``Marker``) marks the same rows again, fenced by the
same lease tokens (the fence decides if a lease moved meanwhile), after a back-off; the
claims wait meanwhile (the pipeline's depth bounds them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relay.config import mask_text
from relay.wakeup import REOPEN_BACKOFF_MAX_S, REOPEN_BACKOFF_S, ReopenBackOff

if TYPE_CHECKING:
    from relay.marker import MarkCancelled

#: A mark the server cancelled again, right after its retry, is split in halves (the first
#: half marked first: a key's rows stay marked in claim order), and those again while they
#: are cancelled, down to this many rows a statement: a ``statement_timeout`` merely shorter
#: than a big mark still lets the marks through.
SPLIT_FLOOR_ROWS = 100
#: A split holds this long after the last cancel: a timeout shorter than big marks costs a
#: cancel and a pair of log lines at most that often, not at each big mark.
SPLIT_HOLD_S = 60.0


#: What becomes of a cancelled mark's rows, said by :func:`say_cancelled`: marked again.
_MARKED_AGAIN = (f"the same rows are marked again on this connection, fenced by the same leases, after a "
                 f"back-off ({REOPEN_BACKOFF_S:g} s doubling up to {REOPEN_BACKOFF_MAX_S:g} s); cancelled "
                 f"again, in halves down to {SPLIT_FLOOR_ROWS} rows. None is published again; new claims "
                 "wait for these marks. Counted in outbox_relay_mark_statements_cancelled_total, said once "
                 "until a mark commits (mark_statement_recovered)")


def say_cancelled(log: Any, connection: str, exc: MarkCancelled, *, then: str) -> None:
    """``mark_statement_cancelled``: the mark of ``exc.rows`` rows on ``connection``, what
    cancels one, what becomes of its rows (``then``) and what to do.  The mark threads' line
    (:class:`MarkCancels`), and the loop's for a mark no mark thread retries (relay/app_deps.py)."""
    log.warning("mark_statement_cancelled", connection=connection, rows=exc.rows,
                cancelled_after_s=round(exc.took_s, 3), error=mask_text(str(exc)),
                detail=f"the server cancelled the mark of {exc.rows} rows on {connection}: a statement_timeout "
                       "shorter than the mark (set on the relay's role or database, or options=-c "
                       "statement_timeout in its DSN), a lock on outbox rows held longer than it, or a "
                       f"pg_cancel_backend. Nothing of it committed and the database answers: {then}. Raise "
                       "the relay role's statement_timeout above its marks' time "
                       "(outbox_relay_mark_duration_seconds) or lift it: ALTER ROLE <role> SET "
                       "statement_timeout = 0; or look for a lock held on outbox rows (pg_locks)")


class MarkCancels:
    """One mark connection's statements cancelled in a row, and the wait before the next
    try (:class:`relay.wakeup.ReopenBackOff`: 1 s doubling, up to 30 s; a smaller part of
    the statement is tried at once: the cancel took the timeout already).  The streak is
    said once (``mark_statement_cancelled``, with what to do) and its end once
    (``mark_statement_recovered``), at the first mark that commits.  Used by the
    connection's mark thread (and the pump's thread, which marks on it only while that
    thread is idle)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, log: Any = None) -> None:
        self._clock = clock
        self.log = log
        self._back_off = ReopenBackOff(clock)
        self._since = 0.0  # the streak's first cancel (clock)
        self._last_at = float("-inf")
        self._split_rows = 0  # rows a statement while a split holds (0: none)

    @property
    def in_a_row(self) -> int:
        """The cancels of the current streak (0: none)."""
        return self._back_off.failures

    def waiting(self) -> bool:
        """Does the next try wait for the back-off now?"""
        return self._back_off.failures > 0 and not self._back_off.due()

    def cancelled(self, connection: str, exc: MarkCancelled) -> bool:
        """Count a cancel of a statement on ``connection``; the first of a streak is said.
        Returns True for it."""
        self._last_at = self._clock()
        if not self._back_off.failures:
            self._since = self._last_at
        if not self._back_off.failed():
            return False
        if self.log is not None:
            say_cancelled(self.log, connection, exc, then=_MARKED_AGAIN)
        return True

    def passed(self, connection: str, rows: int) -> None:
        """A mark of ``rows`` committed on ``connection``: a streak ends, said once."""
        cancels = self._back_off.passed()
        if cancels and self.log is not None:
            self.log.info("mark_statement_recovered", connection=connection, cancelled=cancels,
                          after_s=round(self._clock() - self._since, 3), rows_per_statement=rows)

    def split(self, rows: int) -> int:
        """Rows for the next try of a statement of ``rows`` just cancelled: the same rows
        after its first cancel, then halves, down to :data:`SPLIT_FLOOR_ROWS`."""
        if self._back_off.failures < 2 or rows <= SPLIT_FLOOR_ROWS:
            return rows
        self._split_rows = max(SPLIT_FLOOR_ROWS, (rows + 1) // 2)
        return self._split_rows

    def statement_rows(self, rows: int) -> int:
        """Rows for the first try of a statement of ``rows``: a split made within
        :data:`SPLIT_HOLD_S` of the last cancel holds."""
        if self._split_rows and self._clock() - self._last_at > SPLIT_HOLD_S:
            self._split_rows = 0
        return min(rows, self._split_rows) if self._split_rows else rows
