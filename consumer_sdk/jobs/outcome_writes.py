"""How an executor writes an attempt's outcome: fenced, and sent again when its reply was lost
(a part of :class:`consumer_sdk.jobs.executor.Executor`).

Each outcome (a success, a retry, a failure and its dead letter, a park, a release, a give-back)
is one fenced write on the attempt's connection (:meth:`FencedWrites._fenced_write`): no row
matched is a lost lease.  A write whose connection broke while it waited for the reply may have
committed all the same (``job_write_unconfirmed``): it is sent again on a new connection until the
lease's local deadline (fenced: written at most once), and one that matches no row there asks
the database whether the row is as this lease's write leaves it (``confirmed``).  A database
failure otherwise leaves the job to its lease; a refusal of the row fails the job for good; a
missing grant goes to the pool (``on_fatal``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from consumer_sdk.errors import DatabaseUnavailable, FatalError, OutboxSdkError
from consumer_sdk.jobs import attempt
from consumer_sdk.jobs._conn import outcome_unknown
from consumer_sdk.jobs.attempt import close, wait_to_resend
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.errors import DatabaseReadOnly, InvalidJob, PrivilegeMissing
from consumer_sdk.jobs.model import DeadReason, Outcome

T = TypeVar("T")

#: A write whose reply was lost is sent again at once, then after these pauses (the last
#: one repeated) until the lease's local deadline.
_RESEND_PAUSES_S = (0.1, 0.5, 1.0)


class FencedWrites:
    """The executor's fenced writes of outcomes (see the module); holds no per-job state."""

    if TYPE_CHECKING:  # the executor's (consumer_sdk/jobs/executor.py)
        on_fatal: Callable[[FatalError], None]

        def _fail(self, ctx: JobContext, reason: DeadReason, exc: BaseException, log: Any,
                  note: str = "") -> Outcome: ...

    def _fenced_write(self, ctx: JobContext, log: Any, write: Callable[[Any], T | None],
                      settle: Callable[[T], Outcome], confirm: Callable[[Any], T | None], *,
                      failing: bool = False, confirmed: str = "outcome_confirmed") -> Outcome:
        """One outcome's fenced write (see :meth:`_write`): ``write`` on a connection returns
        what it wrote (None: no row matched, the lease is lost), ``settle`` counts it and names
        the outcome.  Its reply lost, it is written again on a new connection and, matching no
        row there, ``confirm`` finds out whether the first one committed (logged ``confirmed``);
        so too when the attempt's session answered read-only (nothing was written there)."""
        def first() -> Outcome:
            done = write(ctx.conn)
            return "lost" if done is None else settle(done)

        def again(conn: Any) -> Outcome:
            done = write(conn)
            if done is not None:
                return settle(done)
            done = confirm(conn)
            if done is None:
                return "lost"
            outcome = settle(done)
            log.info(confirmed, outcome=outcome, detail="an earlier statement had written it: its reply was lost")
            return outcome

        return self._write(ctx, log, first, failing=failing, again=again)

    def _write(self, ctx: JobContext, log: Any, write: Callable[[], Outcome], *, failing: bool = False,
               again: Callable[[Any], Outcome] | None = None) -> Outcome:
        """Run one fenced write.  A database failure leaves the job to its lease (with ``again``,
        one whose reply was lost is sent again first: see :meth:`_resend`); a refusal of the row
        fails the job for good (``failing``: this was its failure's write, which cannot be
        written either: left to its lease); a missing grant goes to ``on_fatal``."""
        ctx.ending = True  # from here this write, not the heartbeat, says whether the lease held
        try:
            outcome = self._send(ctx, log, write, again)
        except InvalidJob as exc:  # written again, it would be refused again (a CHECK, a trigger...)
            if not failing:
                return self._fail(ctx, "permanent_error", exc, log)
            ctx.cancel("write_rejected")
            log.error("job_write_refused", error=str(exc),
                      hint="the database refused the job's failure too: it is left to its lease")
            return "lost"
        except OutboxSdkError as exc:
            ctx.cancel("write_failed")
            log.warning("job_write_failed", error=str(exc))
            # Not reused: a handler may have left the session unfit for the pool's statements
            # (SET search_path, a statement_timeout), and every later job of this executor
            # failed its writes and waited out its lease (an audit of the worker pool).
            close(ctx.conn)
            if isinstance(exc, PrivilegeMissing):  # a deployment error: every job would meet it
                self.on_fatal(exc)
            return "lost"
        if outcome == "lost":
            log.warning("lease_lost", detail="a fenced write matched no row")
        return outcome

    def _send(self, ctx: JobContext, log: Any, write: Callable[[], Outcome],
              again: Callable[[Any], Outcome] | None) -> Outcome:
        """``write``, or ``again`` on a new connection when the attempt's is dead (a write there sends
        nothing) or when its session answered read-only (nothing written: the session may stay so,
        and a multi-host DSN finds the new primary only on a new one).  Until an audit only a
        give-back went on a new connection then: a retry, a failure or a park met 25006 there
        and left the job to its lease (``job_write_failed``)."""
        if again is not None and (ctx.conn.closed or ctx.conn.broken):
            return self._resend(ctx, log, again, None)
        try:
            return write()
        except DatabaseUnavailable as exc:
            if again is not None and isinstance(exc, DatabaseReadOnly):
                log.warning("job_write_read_only", error=str(exc),
                            detail="the attempt's session is read-only: written on a new connection")
                return self._resend(ctx, log, again, None)
            if again is None or not outcome_unknown(exc, ctx.conn):
                raise
            return self._resend(ctx, log, again, exc)

    def _resend(self, ctx: JobContext, log: Any, again: Callable[[Any], Outcome],
                exc: DatabaseUnavailable | None) -> Outcome:
        """``again`` writes the outcome on a new connection (fenced: once), finding out whether an earlier
        write did (``exc``: its reply was lost; None: nothing was sent), until the lease's local deadline or
        a cancellation (once at least: :func:`~consumer_sdk.jobs.attempt.wait_to_resend`); raises the last failure."""
        if exc is not None:
            log.warning("job_write_unconfirmed", error=str(exc),
                        detail="the connection broke while the outcome was being written: sent again on a "
                               "new connection, which finds out whether it was")
        pauses = iter(_RESEND_PAUSES_S)
        while True:
            conn = None
            try:
                conn = ctx.reconnect()
                return again(conn)
            except DatabaseUnavailable as failed:
                if exc is None and conn is None:  # nothing sent yet, and nothing can be
                    log.warning("job_write_not_sent", error=str(failed), detail=attempt.NOT_SENT)
                exc = failed
            if not wait_to_resend(ctx, next(pauses, _RESEND_PAUSES_S[-1])):
                raise exc
