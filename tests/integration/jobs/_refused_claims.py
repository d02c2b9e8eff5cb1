"""A worker pool whose claims the database refuses, on a real PostgreSQL: what the tests of
refused claims share (test_jobs_claim_refusals.py, test_jobs_missing_tables.py).

The trigger counts every claim in a sequence, which a refused statement does not roll
back, so a test can wait on the refusals the database made.  The run checks what every
refused claim must give, whatever the cause (back-off, health, metrics, one log line per
cause, nothing lost); each test then checks the database's words for its own cause.

The assertions here carry their messages: pytest rewrites only the test modules' asserts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows

FAST = {"poll_interval_s": 0.05, "reconcile_interval_s": 0.5, "listen": False, "drain_timeout_s": 1.0}

#: A claim trigger's function: its line 3 counts the claim, its line 4 is the caller's.
CLAIM_TRIGGER = """
CREATE SEQUENCE {name};
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval({sequence});
    {then}
END $$;
CREATE TRIGGER {name} BEFORE UPDATE ON jobs FOR EACH ROW
    WHEN (OLD.status = 'queued' AND NEW.status = 'running') EXECUTE FUNCTION {name}();
"""


def on_every_claim(conn: psycopg.Connection[Any], name: str, then: str) -> None:
    """Run ``then`` (PL/pgSQL, at line 4 of the function ``name``) at every claim, a queued
    job becoming running, after counting the claim in the sequence ``name`` (claims_tried).
    The trigger and its function are called ``name`` too."""
    conn.execute(sql.SQL(CLAIM_TRIGGER).format(name=sql.Identifier(name), sequence=sql.Literal(name),
                                               then=sql.SQL(then)))


def claims_tried(jobs_db: str, name: str) -> int:
    """How many claims the trigger ``name`` saw, refused ones included."""
    last_value, is_called = rows(jobs_db, sql.SQL("SELECT last_value, is_called FROM {}").format(
        sql.Identifier(name)))[0]
    return int(last_value) if is_called else 0


def job_rows(jobs_db: str) -> list[tuple[Any, ...]]:
    return rows(jobs_db, "SELECT kind, status, attempts FROM jobs ORDER BY id")


def pool_of(jobs_db: str, handlers: dict[str, Any], logged: list[dict[str, Any]], **options: Any) -> WorkerPool:
    config = WorkerConfig(**{"dsn": jobs_db, "max_concurrency": 2, "lease_duration_s": 30.0, **FAST, **options})
    return WorkerPool(config, handlers, log=recording_logger(logged))


def sample(pool: Any, name: str, statement: str) -> float | None:
    return pool.metrics.registry.get_sample_value(name, {"statement": statement})


@dataclass(frozen=True)
class RefusedClaims:
    """What the database's words reached while it refused the claims."""

    reason: str  # the pool's one reason not to be ready
    refused: dict[str, Any]  # the one dispatch_refused line


def refuse_claims_while_a_job_runs(conn: psycopg.Connection[Any], jobs_db: str, *, refuse: Callable[[], object],
                                   let_through: Callable[[], object], refusals: Callable[[], int]) -> RefusedClaims:
    """Run a pool with a job running; call ``refuse`` so that the database refuses the next
    claims (``refusals`` counts them), enqueue three jobs, then call ``let_through``.

    Checked: the refused claim is tried again with back-off; the pool is not ready, for one
    reason, with the metrics an alert reads (OutboxJobsDispatchRefused); the running job's
    success is still written and nothing else is claimed meanwhile (no attempt counted);
    once the database lets the claims pass, the three run their first attempt, the pool is
    ready again, and the cause was logged once (dispatch_refused, then dispatch_resumed)."""
    logged: list[dict[str, Any]] = []
    release = threading.Event()
    pool = pool_of(jobs_db, {"slow": lambda ctx: release.wait(20) and "slow", "ok": lambda ctx: "fine"}, logged)
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="slow", payload={})])
        wait_until(lambda: job_rows(jobs_db) == [("slow", "running", 1)], timeout_s=20, message="claimed")
        refuse()
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="ok", payload={}) for _ in range(3)])
        wait_until(lambda: refusals() >= 1, timeout_s=20, message="a claim was refused")
        first = time.monotonic()
        # Tried again with back-off, not at every poll (0.05 s): three refusals take a while.
        wait_until(lambda: refusals() >= 3, timeout_s=20, message="refused again")
        assert time.monotonic() - first >= 0.5, "the refused claim was tried again without back-off"
        health = wait_until(lambda: (h := pool.health()).refusals.get("claim", 0) >= 3 and h, timeout_s=5,
                            message=lambda: f"the pool's health says so: {pool.health()}")
        assert not health.ready and pool.error is None, health
        assert len(health.reasons) == 1, health
        assert sample(pool, "outbox_jobs_dispatch_refused", "claim") == 1.0, "the refused gauge"
        assert (sample(pool, "outbox_jobs_dispatch_refusals_total", "claim") or 0) >= 3, "the refusals counted"
        release.set()  # a running job's success is still written
        wait_until(lambda: job_rows(jobs_db)[0] == ("slow", "succeeded", 1), timeout_s=10,
                   message=lambda: f"the success was written: {job_rows(jobs_db)}")
        assert not pool.health().ready, pool.health()
        assert job_rows(jobs_db)[1:] == [("ok", "queued", 0)] * 3, f"nothing claimed meanwhile: {job_rows(jobs_db)}"
        let_through()
        wait_until(lambda: job_rows(jobs_db)[1:] == [("ok", "succeeded", 1)] * 3, timeout_s=40,
                   message=lambda: f"claimed once the database let it: {job_rows(jobs_db)}")
        wait_until(lambda: pool.health().ready, timeout_s=5, message=lambda: str(pool.health()))
        assert pool.health().refusals["claim"] >= 3, pool.health()  # a counter: what was refused stays counted
        assert sample(pool, "outbox_jobs_dispatch_refused", "claim") == 0.0, "the refused gauge, after"
    finally:
        release.set()
        pool.stop()
    refused = [e for e in logged if e["event"] == "dispatch_refused"]
    # Logged once for the cause, although each refusal named another job.
    assert len(refused) == 1 and refused[0]["statement"] == "claim", refused
    resumed = [e for e in logged if e["event"] == "dispatch_resumed"]
    assert len(resumed) == 1, resumed
    failed = [e for e in logged if e["event"] in ("dispatch_failed", "dispatch_crashed")]
    assert not failed, failed
    assert dict(pool.outcomes) == {"succeeded": 4}, pool.outcomes
    return RefusedClaims(reason=health.reasons[0], refused=refused[0])
