"""Retry decisions for failed attempts (pure: no I/O, randomness injected).

A handler's exception decides: :class:`~consumer_sdk.errors.PermanentError`
(and :class:`~consumer_sdk.jobs.errors.PermanentJobError`) fails the job at once;
:class:`~consumer_sdk.jobs.errors.LeaseLost` means the worker writes nothing;
anything else is transient and retried with capped exponential back-off and
jitter until ``max_attempts`` attempts were made.  A failure because the database
connection broke (:func:`connection_broke`), because of a conflict (SQLSTATE class 40: a
deadlock, a serialization failure) or because the database was read-only (25006: a failover,
a pooler routing to a standby) is not the job's (:func:`interruption`): the executor gives the
job back without counting the attempt, up to the pool's ``max_interruptions`` in all.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import psycopg

from consumer_sdk import _pg
from consumer_sdk.errors import PermanentError, TransactionConflict
from consumer_sdk.jobs import _check
from consumer_sdk.jobs.errors import DatabaseReadOnly, InvalidJob, LeaseLost
from consumer_sdk.jobs.metrics import Interruption
from consumer_sdk.rejections import message_of
from outbox_core.backoff import backoff_s, ceiling_s

Verdict = Literal["retry", "fail_permanent", "fail_exhausted", "lost"]



MAX_MULTIPLIER = 1000.0


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """Delay before attempt ``n + 1`` after attempt ``n`` failed, in seconds.

    The ceiling grows as ``initial_s * multiplier ** (n - 1)`` up to ``max_s``;
    the delay is drawn uniformly from ``[ceiling * (1 - jitter), ceiling]`` so
    that jobs that failed together do not come back together.

    Checked at construction (:class:`~consumer_sdk.jobs.errors.InvalidJob`, a
    ``ValueError``): ``0 <= initial_s <= max_s <= 100 years``, all finite;
    ``multiplier`` finite from 1 to 1,000; ``jitter`` within [0, 1].
    """

    initial_s: float = 1.0
    max_s: float = 300.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        _check.seconds("Backoff initial_s", self.initial_s, 0.0, _check.MAX_DELAY_S)
        _check.seconds("Backoff max_s", self.max_s, 0.0, _check.MAX_DELAY_S)
        if not self.initial_s <= self.max_s:
            raise InvalidJob(f"Backoff needs 0 <= initial_s <= max_s, got initial_s={self.initial_s!r}, "
                             f"max_s={self.max_s!r}")
        _check.seconds("Backoff multiplier", self.multiplier, 1.0, MAX_MULTIPLIER, unit="times")
        _check.seconds("Backoff jitter", self.jitter, 0.0, 1.0, unit="fractions of the ceiling")

    def ceiling_s(self, failed_attempt: int) -> float:
        return ceiling_s(failed_attempt, initial_s=self.initial_s, max_s=self.max_s, multiplier=self.multiplier)

    def delay_s(self, failed_attempt: int, rand: Callable[[], float] = random.random) -> float:
        return backoff_s(failed_attempt, initial_s=self.initial_s, max_s=self.max_s, multiplier=self.multiplier,
                         jitter=self.jitter, rand=rand)


def verdict(exc: BaseException, *, attempts: int, max_attempts: int) -> Verdict:
    """What to do after attempt number ``attempts`` (1-based) raised ``exc``."""
    if isinstance(exc, LeaseLost):
        return "lost"
    if isinstance(exc, PermanentError):
        return "fail_permanent"
    if attempts >= max_attempts:
        return "fail_exhausted"
    return "retry"


#: How far down an exception's causes (``raise ... from``, or raised while handling) to look.
_CAUSES_LOOKED_AT = 8


def connection_broke(exc: BaseException, conn: Any) -> bool:
    """The attempt failed because a database connection broke, not because of the job:
    ``exc``, or one of its causes, is a session ended by the server (SQLSTATE 57P01-57P03 or
    class 08), or psycopg's OperationalError or InterfaceError without a SQLSTATE (the
    network dropped, the server went away) while the job's connection ``conn`` is closed or
    broken.  A statement the server cancelled (57014: statement_timeout, a cancel request)
    or a lock it did not get in time (55P03) ends the statement, not the session: they are
    the job's, failures as before."""
    dead = bool(conn.closed or conn.broken)
    seen: BaseException | None = exc
    for _ in range(_CAUSES_LOOKED_AT):
        if seen is None:
            return False
        # The inbox store's judgement (consumer_sdk/_pg.py), one without a SQLSTATE only on
        # a dead connection (a handler's own error without one is not the network's).
        if isinstance(seen, psycopg.Error) and _pg.connection_failed(seen) and (seen.sqlstate or dead):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def interruption(exc: BaseException, conn: Any) -> Interruption | None:
    """Why the attempt failed through no fault of its job, None when it may be the job's:
    the connection broke (:func:`connection_broke`); a conflict, ``exc`` or one of its causes
    a :class:`~consumer_sdk.errors.TransactionConflict` or an error of SQLSTATE class 40 (a
    deadlock 40P01, a serialization failure 40001: the database chose this transaction to
    abort, and it may well commit next time); or a read-only database, a
    :class:`~consumer_sdk.jobs.errors.DatabaseReadOnly` or SQLSTATE 25006 (a failover in
    progress, a pooler routing to a standby).  The inbox consumer retries both uncounted too."""
    if connection_broke(exc, conn):
        return "connection_broke"
    seen: BaseException | None = exc
    for _ in range(_CAUSES_LOOKED_AT):
        if seen is None:
            return None
        state = (seen.sqlstate or "") if isinstance(seen, psycopg.Error) else ""
        if isinstance(seen, TransactionConflict) or state.startswith("40"):
            return "conflict"
        if isinstance(seen, DatabaseReadOnly) or state == "25006":
            return "read_only"
        seen = seen.__cause__ or seen.__context__
    return None


def describe(exc: BaseException, *, limit: int = 2000) -> str:
    """A readable one-paragraph error for the dead letter: ``Type: message``, bounded, and
    text PostgreSQL can store.  An exception whose ``__str__`` raised, or whose message held
    a NUL or lone surrogates (bytes decoded with ``surrogateescape``), made the attempt's
    write fail: no back-off, the job left to its lease, and its dead letter said the
    workers had stopped renewing it (an audit of the worker pool)."""
    text = message_of(exc).strip() or "(no message)"
    line = storable(f"{error_type(exc)}: {text}")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def error_type(exc: BaseException) -> str:
    """The exception's class name, as stored in ``last_error_type`` (bounded)."""
    return storable(type(exc).__name__)[:200]


def storable(text: str) -> str:
    """``text`` with lone surrogates as ``\\udcXX`` and NUL as ``\\x00``: PostgreSQL's text
    holds neither."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


#: How each interruption reads in a dead letter's note (see :func:`interruptions_note`).
_SAID: dict[Interruption, str] = {"connection_broke": "its database connection broke",
                                  "conflict": "a conflict (a deadlock or a serialization failure)",
                                  "read_only": "a read-only database"}


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def interruptions_note(cause: Interruption, spent: dict[Interruption, int], limit: int) -> str:
    """What a counted attempt's error adds when ``cause`` interrupted it past the pool's
    ``max_interruptions`` (``limit``), spent on ``spent`` (how many times each cause interrupted
    the job's attempts before: past the budget they are no longer counted).  Only the
    connection broke, ever: :func:`interrupted_note`'s words, as before."""
    if cause == "connection_broke" and not spent.get("conflict") and not spent.get("read_only"):
        return interrupted_note(spent.get("connection_broke", 0) + 1, limit)
    each = ", ".join(f"{_SAID[why]} {_times(n)}" for why, n in spent.items() if n > 0)
    return (f" (through no fault of its own again: {_SAID[cause]}; the pool's max_interruptions={limit} were "
            f"spent ({each}), so each such attempt counts)")


def interrupted_note(times: int, limit: int) -> str:
    """What a counted attempt's error adds when the database connection broke under it past
    the pool's ``max_interruptions`` (``limit``): ``times`` the connection broke in all."""
    return (f" (the database connection broke under this job's attempts {_times(times)}: past the pool's "
            f"max_interruptions={limit}, each such attempt counts)")
