"""Helpers of one attempt as the executor runs it: its log line's fields, its success to
write later, its error as written, its connection tidied or dropped after the handler, and
the pauses before an outcome is sent again.

Kept apart from :mod:`consumer_sdk.jobs.executor`, which decides and writes outcomes.
"""

from __future__ import annotations

import time
from typing import Any

from consumer_sdk.jobs._conn import roll_back_open
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.errors import LeaseLost
from consumer_sdk.jobs.retry import describe

#: Why ``job_write_not_sent``: the outcome's write needs a new connection, and none can be made yet.
NOT_SENT = ("the job's connection broke and no new one can be made (the database is still unreachable): nothing "
            "of its outcome was written yet; tried again until the lease's local deadline, then job_write_failed "
            "and the job waits out its lease (the reaper queues it again, the attempt counted, or on its last "
            "attempt dead-letters it lease_expired)")


class JobLog:
    """The executor's logger bound to one job's fields, bound only when something is logged."""

    __slots__ = ("_base", "_job", "_bound")

    def __init__(self, base: Any, job: Any) -> None:
        self._base, self._job, self._bound = base, job, None

    def __getattr__(self, name: str) -> Any:
        if self._bound is None:
            job = self._job
            self._bound = self._base.bind(job_id=job.id, queue=job.queue, kind=job.kind, attempt=job.attempts,
                                          token=job.token, trace_id=trace_id(job.traceparent))
        return getattr(self._bound, name)


class Later:
    """A success to hand to ``complete_later``: its result, encoded."""

    __slots__ = ("result_json",)

    def __init__(self, result_json: str) -> None:
        self.result_json = result_json


def error_written(exc: BaseException, note: str) -> str:
    """The attempt's error as written: ``describe``'s, then ``note`` (within its bound)."""
    return describe(exc, limit=2000 - len(note)) + note


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C traceparent (``00-<trace id>-<span id>-<flags>``), for log lines."""
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 else None


def wait_to_resend(ctx: JobContext, pause_s: float) -> bool:
    """Wait ``pause_s`` (less on cancellation) before an outcome is sent again; False when it
    is not to be: the lease's local deadline comes first, or the attempt was cancelled (the
    pool stops).  The heartbeat leaves an attempt whose outcome was sent alone (``ending``):
    the outcome written by this very lease moved the job out of 'running', which it read as
    a lost lease; its cancellation ended the sending of an outcome the database had (an
    audit), then earned one more try, and it was logged ``lease_lost`` all the same."""
    if time.monotonic() + pause_s >= ctx.deadline:
        return False
    try:
        ctx.sleep(pause_s)  # wakes at once on cancellation
    except LeaseLost:
        pass
    return not ctx.cancelled


def tidy(ctx: JobContext) -> None:
    """Roll back a transaction the handler left open, so the outcome commits on its own."""
    conn = ctx.conn
    if conn.closed or conn.broken:
        return
    if not roll_back_open(conn):
        return
    if not conn.autocommit:
        conn.autocommit = True


def close(conn: Any) -> None:
    """Close the executor's connection: its slot opens another for the next job."""
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - best effort on a connection being dropped
        pass
