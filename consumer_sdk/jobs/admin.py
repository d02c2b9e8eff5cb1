"""Operators' reads and repairs: dead letters (list, requeue) and retention."""

from __future__ import annotations

from datetime import datetime

from consumer_sdk.jobs._db import ConnectionT, q, translated
from consumer_sdk.jobs.model import DeadLetterRecord, JobId, RunId


def dead_letters(conn: ConnectionT, *, queue: str | None = None, job_id: int | None = None,
                 limit: int = 50) -> list[DeadLetterRecord]:
    """The newest dead letters first (of one queue, or one job)."""
    with translated():
        rows = conn.execute(q("dead_letters"), {"queue": queue, "job_id": job_id,
                                                "limit": limit}).fetchall()
    return [DeadLetterRecord(
        job_id=JobId(r[0]), run_id=None if r[1] is None else RunId(r[1]), owner_id=r[2], queue=r[3],
        kind=r[4], reason=r[5], error=r[6], error_type=r[7], attempts=r[8], traceparent=r[9],
        trace_id=r[10], dead_at=r[11]) for r in rows]


def requeue_dead(conn: ConnectionT, job_id: int, *, now: datetime | None = None) -> bool:
    """Queue a dead-lettered job again with a fresh attempt budget; False when there is none."""
    with translated():
        return conn.execute(q("requeue_dead"), {"job_id": job_id, "now": now}).fetchone() is not None


def cleanup(conn: ConnectionT, *, older_than_s: float, batch: int = 1000, max_batches: int = 100,
            now: datetime | None = None) -> tuple[int, int]:
    """Retention in bounded batches, each its own short transaction.

    Deletes runs and jobs that ended more than ``older_than_s`` seconds ago (failed
    ones only once their dead letter is gone) and activations nothing refers to
    any more.  Returns ``(runs_and_jobs, activations)`` deleted.
    """
    totals = [0, 0]
    for i, name in enumerate(("cleanup_finished", "cleanup_activations")):
        for _ in range(max_batches):
            params = {"older_than_s": older_than_s, "limit": batch, "now": now}
            with translated():
                cur = conn.execute(q(name), params)
                row = cur.fetchone() if cur.description else None
            deleted = int(row[0]) if row else max(cur.rowcount, 0)
            totals[i] += deleted
            if deleted < batch:
                break
    return totals[0], totals[1]
