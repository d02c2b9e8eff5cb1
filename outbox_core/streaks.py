"""Failures in a row (a streak), and when to say so: at its first failure, at once when their
kind changes, else every ``every_s`` while it lasts; its end once, with the count and how long
it lasted.  Pure (``now``: the caller's monotonic seconds); one thread, or the caller's lock."""

from __future__ import annotations

__all__ = ["FailureStreak"]


class FailureStreak:
    """:meth:`failed` counts a failure and answers "say it now?"; :meth:`passed` ends the streak."""

    def __init__(self, *, every_s: float) -> None:
        self.every_s = every_s
        self.failures = 0  # in a row (0: no streak under way)
        self.began = 0.0  # when its first failure began
        self._said_at = 0.0  # the last line's
        self._kind: object = None  # the last failure's (a change is always said)

    def failed(self, now: float, *, kind: object = None, began: float | None = None) -> bool:
        """Count a failure at ``now`` of ``kind`` (``began``: when the attempt that failed began,
        ``now`` when not given).  True when it is worth a line: the streak's first, another
        ``kind`` than the last failure's, or ``every_s`` or more after the last line."""
        self.failures += 1
        if self.failures == 1:
            self.began = now if began is None else began
        elif kind == self._kind and now - self._said_at < self.every_s:
            return False
        self._said_at, self._kind = now, kind
        return True

    def passed(self, now: float) -> tuple[int, float]:
        """An attempt passed at ``now``: the streak ends.  Its failures (0: there was none) and
        how long it lasted (seconds since its first failure began)."""
        ended, self.failures = (self.failures, now - self.began if self.failures else 0.0), 0
        return ended
