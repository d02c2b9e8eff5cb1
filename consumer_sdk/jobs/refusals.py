"""The database's refusals of a worker pool's own statements, and what the pool says of its health.

A trigger that raises on the jobs table's UPDATE, a CHECK constraint, a policy, a table a
trigger uses dropped (:class:`~consumer_sdk.jobs.errors.TableMissing`), the jobs tables
themselves missing (:class:`~consumer_sdk.errors.SchemaMissing`: not migrated yet when the
pool starts, dropped or renamed while it runs): the database can refuse the dispatcher's
claim (``claim``: the lanes' read and a round's completions too) or its upkeep (``reap``:
the reconciler's pass or the reaper, which resume parked jobs and requeue expired ones) for
as long as a person leaves it so.  Each round met the same refusal, logged it (``dispatch_failed``) and tried
again after at most ``poll_interval_s``, for ever, with no metric nor state an operator
would see; a refused reap stopped every claim too (an audit of the pool).  Now:

* the statement is tried again with back-off (:data:`REFUSED_BACKOFF`: 0.25-0.5 s, doubling
  up to 15-30 s), never faster, whatever wakes the pool;
* each refusal is counted (:class:`PoolHealth` ``refusals`` and
  ``outbox_jobs_dispatch_refusals_total``, by statement; ``outbox_jobs_dispatch_refused`` is 1
  while it lasts);
* each distinct cause (statement, SQLSTATE, constraint, the trigger's function) is logged
  once (``dispatch_refused``, an error with the database's message), and the end of the
  refusals once (``dispatch_resumed``);
* :meth:`~consumer_sdk.jobs.worker.WorkerPool.health` is not ready while it lasts, and says why;
* no job is dropped: a refused claim changed nothing, a refused reap leaves the expired
  jobs for the next pass (the pool claims on meanwhile), and successes are written by
  their executors while claims are refused (the round that carries them is the claim's).

A missing table went the old way until an audit (``dispatch_failed`` at every round, the pool
said ready), as did a missing jobs schema at the start.  The jobs schema's refusal ends once
the pool's check of its tables passes (a round with nothing to claim proves that much);
the others, once a claim is sent and passes.

A missing grant is not a refusal of this kind: it stops the pool
(:class:`~consumer_sdk.jobs.errors.PrivilegeMissing`, ``pool.error``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from consumer_sdk.errors import OutboxSdkError, SchemaMissing
from consumer_sdk.jobs._db import refusal_cause
from consumer_sdk.jobs.errors import InvalidJob, TableMissing
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.retry import Backoff

Statement = Literal["claim", "reap"]
#: The pause after the n-th refusal in a row of a statement.
REFUSED_BACKOFF = Backoff(initial_s=0.5, max_s=30.0, multiplier=2.0, jitter=0.5)


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """What a service's readiness probe reports of its worker pool: ``ready`` when it runs
    and claims; else ``reasons``, one line each (the fatal error, a refused statement with
    the database's words, a database unavailable or read-only for a while, or not answering a
    dispatch round in flight (a partition that drops packets): :mod:`consumer_sdk.jobs.outage`).  ``refusals``: the refusals of each statement since the
    pool started (a counter)."""

    ready: bool
    reasons: tuple[str, ...] = ()
    refusals: Mapping[str, int] = field(default_factory=dict)
    #: Handlers that ran past ``handler_timeout_s`` and have not returned: each holds its
    #: thread and its slot (Python cannot kill a thread); not ready once every slot is so held.
    stuck_handlers: int = 0
    #: The dispatcher's rounds failed in a row because the database is unavailable or read-only
    #: (0 once one passes); not ready once there are two of them, two seconds old (:mod:`.outage`).
    failed_rounds: int = 0


class Refused(InvalidJob):
    """The database refused the worker pool's own statement; try it again in ``pause_s``."""

    def __init__(self, message: str, *, pause_s: float) -> None:
        super().__init__(message)
        self.pause_s = pause_s


#: What the database refuses the pool's statements for (see the module).
REFUSALS = (InvalidJob, SchemaMissing)


class Refusals:
    """The refusals of the dispatcher's statements now in force (thread-safe)."""

    def __init__(self, *, log: Any, rand: Callable[[], float], metrics: JobsMetrics | None = None) -> None:
        self.log = log
        self.metrics = metrics if metrics is not None else JobsMetrics()
        self._rand = rand
        self._lock = threading.Lock()
        self._now: dict[Statement, tuple[str, int]] = {}  # statement: (its message, refusals in a row)
        self._schema: set[Statement] = set()  # those refused because the jobs schema is missing (the last time)
        self._logged: set[tuple[str, ...]] = set()  # the causes logged since the last passing statement
        self._total: Counter[str] = Counter()  # refusals since the start, by statement

    def refused(self, statement: Statement, exc: OutboxSdkError) -> float:
        """The database refused ``statement`` (``exc``): count it, log a new cause; returns
        the pause before it is tried again."""
        cause = (statement, *refusal_cause(exc))
        with self._lock:
            count = self._now.get(statement, ("", 0))[1] + 1
            self._now[statement] = (str(exc), count)
            (self._schema.add if _schema(exc) else self._schema.discard)(statement)
            new = cause not in self._logged
            self._logged.add(cause)
            self._total[statement] += 1
        self.metrics.dispatch_refusals.labels(statement).inc()
        self.metrics.dispatch_refused.labels(statement).set(1)
        pause_s = REFUSED_BACKOFF.delay_s(count, self._rand)
        if new:
            self.log.error("dispatch_refused", statement=statement, error=str(exc), sqlstate=cause[1],
                           refusals=count, hint=_hint(exc))
        return pause_s

    @contextmanager
    def watch(self, statement: Statement, *, sent: bool = True) -> Iterator[None]:
        """Around ``statement``: its refusal is :meth:`refused` and raised as :class:`Refused`
        (with the pause); it passed (:meth:`passed`) when it was ``sent`` (a round with nothing
        to claim sends no claim: that proves nothing)."""
        try:
            yield
        except Refused:
            raise
        except REFUSALS as exc:
            raise Refused(str(exc), pause_s=self.refused(statement, exc)) from exc
        if sent:
            self.passed(statement)

    def passed(self, statement: Statement) -> None:
        """``statement`` went through: the refusals of it are over."""
        if statement not in self._now:  # the usual case, without the lock
            return
        with self._lock:
            ended = self._now.pop(statement, None)
            self._schema.discard(statement)
            self._logged = {c for c in self._logged if c[0] != statement}
        if ended is not None:
            self.metrics.dispatch_refused.labels(statement).set(0)
            self.log.info("dispatch_resumed", statement=statement, refusals=ended[1])

    def refusing(self, statement: Statement) -> bool:
        return statement in self._now

    def schema_missing(self, statement: Statement) -> bool:
        """``statement`` is refused because the jobs schema is missing: the pool's check of the
        jobs tables passing ends that refusal (no claim need be sent)."""
        return statement in self._schema

    def health(self, *, error: BaseException | None, started: bool, stopping: bool, stuck: int = 0,
               capacity: int = 0, database: str | None = None, failed_rounds: int = 0) -> PoolHealth:
        """A pool's health: ``error`` (what stopped it), not ``started``, ``stopping``, the
        refusals in force, ``stuck`` handlers (not ready when they hold all ``capacity``), and
        ``database``: why the database fails the dispatcher's rounds (``failed_rounds`` of them
        in a row), when it has for a while (:meth:`consumer_sdk.jobs.outage.Outage.reason`)."""
        with self._lock:
            now, total = sorted(self._now.items()), dict(self._total)
        down = (f"failed: {error}" if error is not None else "not started" if not started
                else "stopping" if stopping else None)
        reasons = ([down] if down else []) + ([database] if database else []) + [
            f"the database refuses the pool's {statement} ({count} times in a row): {message}"
            for statement, (message, count) in now]
        if stuck and stuck >= capacity:
            reasons.append(f"all {capacity} worker slots are held by handlers that ran past handler_timeout_s and "
                           "never returned (a thread cannot be killed): fix the handler, restart the process")
        return PoolHealth(ready=not reasons, reasons=tuple(reasons), refusals=total, stuck_handlers=stuck,
                          failed_rounds=failed_rounds)


_HINT = ("a trigger, a constraint or a policy of the database refuses the pool's own statement: it is tried "
         "again with back-off, the jobs left as they are, until the database lets it pass")
_TABLE_HINT = ("a trigger or function the pool's statement runs uses a missing table: create it again or fix the "
               "function; the statement is tried again with back-off, the jobs left as they are")
_SCHEMA_HINT = ("the jobs tables are missing (not migrated, dropped or renamed, or another search_path): run "
                "`outbox-relay migrate`; the pool checks again with back-off and claims once they are there")


def _schema(exc: BaseException) -> bool:
    """``exc`` says the jobs schema itself is missing (not a trigger's table)."""
    return isinstance(exc, SchemaMissing) and not isinstance(exc, TableMissing)


def _hint(exc: BaseException) -> str:
    return _SCHEMA_HINT if _schema(exc) else _TABLE_HINT if isinstance(exc, TableMissing) else _HINT
