"""A claim round stops at its byte budget (WorkerConfig.claim_max_bytes).

Before, a claim took as many jobs as the pool had free slots whatever their payloads, and
returned them all in one result, decoded at once: 64 jobs of 200 MB were 13 GB in the worker
process, killed for it, and each replica that claimed them after it too.  Here 400 KB jobs
and a 1 MB budget: at most three a round (the third crosses the budget and is taken).
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from consumer_sdk.jobs import JobContext, NewJob, accept, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.config import WorkerConfig
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.model import Take
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import at, rows

BUDGET = 1_000_000
KB400 = 400_000


def _incompressible(size: int) -> dict[str, str]:
    """A payload of about ``size`` bytes that TOAST stores uncompressed (random text)."""
    return {"blob": secrets.token_urlsafe(size * 3 // 4)}


def _claim(conn: Any, takes: list[Take], now_s: float) -> list[Any]:
    return jobq.claim(conn, worker="w", takes=takes, lease_s=30, now=at(now_s), max_bytes=BUDGET)


def test_a_round_stops_at_its_byte_budget_compressed_payloads_counted_as_text(conn):
    """Ten jobs of 400 KB of text that compresses to a few KB: measured by their stored
    size, all ten fitted.  Counted decompressed, three are claimed (before: all ten)."""
    enqueue(conn, [NewJob(owner_id="o1", queue="bulk", kind="big", payload={"blob": "x" * KB400})
                   for _ in range(10)], now=at(0))
    stored = conn.execute("SELECT max(pg_column_size(payload)) FROM jobs").fetchone()[0]
    assert stored < KB400 // 10  # stored compressed: the test means what it says
    got = _claim(conn, [Take("bulk", "o1", 10, jobq.NO_OWNER_LIMIT)], 1)
    assert len(got) == 3 and all(len(job.payload["blob"]) == KB400 for job in got)
    assert len(_claim(conn, [Take("bulk", "o1", 10, jobq.NO_OWNER_LIMIT)], 1)) == 3  # the next ones


def test_the_budget_deals_lanes_in_turn_and_a_huge_job_runs_alone(conn):
    """Two owners' 400 KB jobs, the budget for about two: each owner gets one (before the
    turns: the first owner's three, the second owner none this round).  A 3 MB job over the
    budget is still claimed, alone, and the small jobs behind it in the next round."""
    enqueue(conn, [NewJob(owner_id=owner, queue="bulk", kind="big", payload=_incompressible(KB400))
                   for owner in ("a", "b") for _ in range(3)], now=at(0))
    got = _claim(conn, [Take("bulk", "a", 3, jobq.NO_OWNER_LIMIT), Take("bulk", "b", 3, jobq.NO_OWNER_LIMIT)], 1)
    assert sorted(job.owner_id for job in got) == ["a", "a", "b"]

    enqueue(conn, [NewJob(owner_id="h", queue="bulk", kind="huge", payload=_incompressible(3 * BUDGET))], now=at(2))
    enqueue(conn, [NewJob(owner_id="h", queue="bulk", kind="small", payload={"i": i}) for i in range(2)], now=at(3))
    take = [Take("bulk", "h", 3, jobq.NO_OWNER_LIMIT)]
    assert [job.kind for job in _claim(conn, take, 4)] == ["huge"]
    assert [job.kind for job in _claim(conn, take, 4)] == ["small", "small"]


def test_runs_goals_count_and_the_interactive_queue_comes_first(conn):
    """A run's job returns its run's goal (its payload is NULL): three runs of 600 KB goals
    are two rounds (the second crosses the budget, the third waits).  The interactive queue's
    jobs come before the bulk queue's, as the plan deals them (a cut delays bulk work)."""
    for key in ("r1", "r2", "r3"):
        accept(conn, owner_id="runs", request_key=key, kind="run", body=_incompressible(600_000), queue="bulk")
    assert len(_claim(conn, [Take("bulk", "runs", 3, jobq.NO_OWNER_LIMIT)], 1)) == 2

    enqueue(conn, [NewJob(owner_id="p", queue=queue, kind=queue, payload=_incompressible(KB400))
                   for queue in ("bulk", "interactive") for _ in range(3)], now=at(0))
    got = _claim(conn, [Take("interactive", "p", 3, jobq.NO_OWNER_LIMIT), Take("bulk", "p", 3, jobq.NO_OWNER_LIMIT)], 1)
    assert [job.kind for job in got] == ["interactive"] * 3


def test_a_pool_claims_within_its_budget_and_runs_every_job(conn, jobs_db, pools):
    """The pool passes claim_max_bytes to its claims: ten 400 KB jobs and ten free slots
    are claimed three at most a round (jobs claimed by one statement share its transaction's
    time as started_at), and all ten succeed.  Before: one round of ten."""
    enqueue(conn, [NewJob(owner_id="o1", queue="bulk", kind="big", payload=_incompressible(KB400))
                   for _ in range(10)])

    def handler(ctx: JobContext) -> int:
        return len(ctx.job.payload["blob"])

    pools({"big": handler}, max_concurrency=10, claim_max_bytes=BUDGET, poll_interval_s=0.2)
    wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'")[0][0] == 10,
               timeout_s=15, message="the ten jobs did not all succeed")
    rounds = [n for (n,) in rows(jobs_db, "SELECT count(*) FROM jobs GROUP BY started_at")]
    assert sum(rounds) == 10 and max(rounds) <= 3, rounds


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "64MiB", 2**40 + 1])
def test_claim_max_bytes_is_checked(value):
    with pytest.raises(InvalidJob, match="claim_max_bytes must be an integer from 1 to"):
        WorkerConfig(dsn="postgresql://jobs@db.example/app", claim_max_bytes=value)
