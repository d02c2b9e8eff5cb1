"""A claim that committed but whose reply never came back (the connection broke while the
dispatcher waited: a database restarting, a network cut), on a real PostgreSQL behind the
fault proxy.

The jobs it claimed are running under the pool's worker id with a live lease, and the pool
knows nothing of them: no handler runs them, the heartbeat does not renew them, and once
their lease runs out the reaper requeues them with the attempt counted, or, on their last
attempt, fails them with a ``lease_expired`` dead letter: a job failed for good that never
ran.  Now the round after such a claim asks the database for the jobs running under this
worker that the pool does not hold and gives them back (``claims_given_back``, the attempt
not counted): the next claim runs them.
"""

from __future__ import annotations

import uuid
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger, rows
from tests.integration.jobs.test_jobs_lost_reply_executor import held_after

__all__ = ["held_after"]  # the fixture, used by name


def _statuses(jobs_db: str) -> list[tuple[Any, ...]]:
    return rows(jobs_db, "SELECT status FROM jobs ORDER BY id")


def test_the_jobs_of_a_claim_whose_reply_was_lost_run_once_their_first_attempt(
        conn, jobs_db, tcp_proxy, held_after) -> None:
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    owner = f"claim-lost-{uuid.uuid4().hex}"  # in the claim's statement, the proxy's marker
    held_after["marker"] = owner.encode()
    ran: list[int] = []
    events: list[dict[str, Any]] = []
    config = WorkerConfig(dsn=make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)), max_concurrency=2,
                          lease_duration_s=6.0, poll_interval_s=0.1, reconcile_interval_s=0.5, listen=False,
                          drain_timeout_s=1.0)
    pool = WorkerPool(config, {"work": lambda ctx: ran.append(ctx.job.attempts) or "done"},
                      log=recording_logger(events))
    pool.start()
    try:
        enqueue(conn, [NewJob(owner_id=owner, queue="bulk", kind="work", payload={}, max_attempts=1)
                       for _ in range(2)])
        assert held_after["held"].wait(30), "the claim was not seen"
        wait_until(lambda: rows(jobs_db, "SELECT status FROM jobs") == [("running",)] * 2, timeout_s=20,
                   message="the server committed the claim")
        proxy.cut()  # its reply never reaches the pool
        proxy.restore()
        # Ended either way: run, or (before) dead-lettered by the reaper once the lease ran out.
        wait_until(lambda: {s for (s,) in _statuses(jobs_db)} <= {"succeeded", "failed"}, timeout_s=30,
                   message=lambda: f"the jobs ended: {_statuses(jobs_db)}")
    finally:
        pool.stop()
    assert rows(jobs_db, "SELECT status, attempts FROM jobs ORDER BY id") == [("succeeded", 1)] * 2, \
        rows(jobs_db, "SELECT status, attempts, last_error FROM jobs ORDER BY id")
    assert ran == [1, 1]
    assert rows(jobs_db, "SELECT count(*) FROM job_dead_letters") == [(0,)]
    given_back = [e for e in events if e["event"] == "claims_given_back"]
    assert [e["jobs"] for e in given_back] == [2], given_back
