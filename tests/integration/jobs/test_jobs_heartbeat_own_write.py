"""The heartbeat and an attempt's own outcome, on a real PostgreSQL: a lease ended by the
attempt's own write is not a lost lease; a lease another worker took over still is.

The race: the heartbeat takes the attempts the pool holds, then sends its statement; the
attempt's outcome (the dispatcher's round writing a success, the executor writing a retry
or a dead letter) commits in between, or while the heartbeat's UPDATE waits for the row
the outcome's write locked.  Its statement then finds the job no longer running and, when
it waited, reads it as it was before (``running``: its snapshot), so the SQL's exception
for a job the same lease completed did not apply.  The heartbeat logged ``lease_lost`` for
an attempt whose outcome its own lease wrote (and the attempt's ``job_attempt_finished``
said ``reason=lease_lost`` next to ``outcome=retried``).  Now the heartbeat leaves an
attempt whose outcome write was sent to that write, which says whether the lease held.

Made certain here: a trigger holds the outcome's write (its row locked) until the pool's
heartbeat waits for that row, so the heartbeat's answer is the one the race gives.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest

from consumer_sdk.jobs import (
    NewJob,
    PermanentJobError,
    TransientJobError,
    WorkerConfig,
    WorkerPool,
    enqueue,
)
from consumer_sdk.jobs.errors import LeaseLost
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows, scalar

#: Holds a 'target' job's outcome write (the row locked by its UPDATE) until another session
#: waits for a lock with the heartbeat's statement (at most 10 s), then records when, and
#: whether a heartbeat did wait.
HOLD_OUTCOME = """
CREATE TABLE t_outcome_written (job_id bigint, status text, heartbeat_waited boolean,
                                at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION t_hold_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    waited boolean := false;
BEGIN
    FOR i IN 1..500 LOOP
        PERFORM pg_stat_clear_snapshot();  -- else read once per transaction
        waited := EXISTS (SELECT 1 FROM pg_stat_activity
                          WHERE pid <> pg_backend_pid() AND wait_event_type = 'Lock'
                            AND query LIKE '%renewed%');
        EXIT WHEN waited;
        PERFORM pg_sleep(0.02);
    END LOOP;
    INSERT INTO t_outcome_written (job_id, status, heartbeat_waited) VALUES (NEW.id, NEW.status, waited);
    RETURN NULL;
END $$;
CREATE TRIGGER t_hold_outcome AFTER UPDATE ON jobs FOR EACH ROW
    WHEN (OLD.status = 'running' AND NEW.status <> 'running' AND NEW.kind = 'target')
    EXECUTE FUNCTION t_hold_outcome();
"""

HANDLERS = {
    "succeeded": lambda ctx: {"done": True},  # written by the dispatcher's next round
    "retried": lambda ctx: _raise(TransientJobError("try again")),  # written by the executor
    "failed": lambda ctx: _raise(PermanentJobError("never")),  # the executor: failed, dead letter
}


def _raise(exc: Exception) -> Any:
    raise exc


def _pool(jobs_db: str, handlers: dict[str, Any], logged: list[dict[str, Any]]) -> WorkerPool:
    config = WorkerConfig(dsn=jobs_db, max_concurrency=2, lease_duration_s=10.0, heartbeat_interval_s=0.1,
                          poll_interval_s=0.05, listen=False, drain_timeout_s=1.0)
    return WorkerPool(config, handlers, log=recording_logger(logged))


def _heartbeat_at(jobs_db: str, kind: str) -> dt.datetime | None:
    value = scalar(jobs_db, "SELECT heartbeat_at FROM jobs WHERE kind = %s", (kind,))
    return value if isinstance(value, dt.datetime) else None


@pytest.mark.parametrize("outcome", sorted(HANDLERS))
def test_a_lease_the_attempts_own_outcome_ended_is_not_called_lost(conn, jobs_db, outcome: str) -> None:
    conn.execute(HOLD_OUTCOME)
    logged: list[dict[str, Any]] = []
    release = threading.Event()
    # "slow" keeps the heartbeat going after the target's outcome: its next statement shows
    # the heartbeat has dealt with the answer the race gave.
    pool = _pool(jobs_db, {"slow": lambda ctx: release.wait(30) and "slow", "target": HANDLERS[outcome]},
                 logged)
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="slow", payload={})])
        wait_until(lambda: _heartbeat_at(jobs_db, "slow") is not None, timeout_s=20, message="slow renewed")
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="target", payload={}, max_attempts=3)])
        written = wait_until(lambda: rows(jobs_db, "SELECT status, heartbeat_waited, at FROM t_outcome_written"),
                             timeout_s=30, message="the target's outcome was written")
        status, heartbeat_waited, written_at = written[0]
        assert heartbeat_waited, "the heartbeat never waited for the outcome's write: the race did not happen"
        wait_until(lambda: (at := _heartbeat_at(jobs_db, "slow")) is not None and at > written_at, timeout_s=20,
                   message="the heartbeat renewed again after the outcome")
        wait_until(lambda: pool.outcomes[outcome] == 1, timeout_s=20, message=lambda: str(pool.outcomes))
    finally:
        release.set()
        pool.stop()
    expected = {"succeeded": "succeeded", "retried": "queued", "failed": "failed"}[outcome]
    assert status == expected
    lost = [e for e in logged if e["event"] == "lease_lost"]
    assert not lost, f"a lease the attempt's own {outcome} ended was called lost: {lost}"
    target = scalar(jobs_db, "SELECT id FROM jobs WHERE kind = 'target'")
    finished = [e for e in logged if e["event"] == "job_attempt_finished" and e["job_id"] == target]
    assert [(e["outcome"], e["reason"]) for e in finished] == [(outcome, None)], finished
    assert pool.metrics.registry.get_sample_value(
        "outbox_jobs_leases_lost_total", {"queue": "bulk", "reason": "lease_lost"}) is None


def test_a_lease_another_worker_took_over_is_still_lost_logged_and_counted(conn, jobs_db) -> None:
    logged: list[dict[str, Any]] = []
    started = threading.Event()
    seen: list[BaseException] = []

    def long_handler(ctx: Any) -> Any:
        started.set()
        try:
            for _ in range(300):
                ctx.sleep(0.1)
        except LeaseLost as exc:
            seen.append(exc)
            raise
        return "never"

    pool = _pool(jobs_db, {"long": long_handler}, logged)
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="long", payload={})])
        assert started.wait(20), "the job never started"
        # Its lease ran out and another worker claimed it: a new owner, a new token.
        conn.execute("UPDATE jobs SET lease_owner = 'another-worker', lease_token = lease_token + 1, "
                     "lease_until = now() + interval '1 minute' WHERE kind = 'long'")
        wait_until(lambda: pool.outcomes["lost"] == 1, timeout_s=20, message=lambda: str(pool.outcomes))
    finally:
        pool.stop()
    assert len(seen) == 1 and isinstance(seen[0], LeaseLost) and seen[0].reason == "lease_lost", seen
    lost = [e for e in logged if e["event"] == "lease_lost"]
    assert [e["reason"] for e in lost] == ["lease_lost"], lost
    assert pool.metrics.registry.get_sample_value(
        "outbox_jobs_leases_lost_total", {"queue": "bulk", "reason": "lease_lost"}) == 1.0
    assert rows(jobs_db, "SELECT status, lease_owner FROM jobs") == [("running", "another-worker")]
