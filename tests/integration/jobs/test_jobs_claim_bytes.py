"""A pool holds at most its payload bytes (WorkerConfig.max_payload_bytes); a claim round
stops at the budget they leave.

Before, a claim took as many jobs as the pool had free slots whatever their payloads, and
returned them all in one result, decoded at once: 64 jobs of 200 MB were 13 GB in the worker
process, killed for it, and each replica that claimed them after it too.  Then a round was
bounded, but not what the pool held: each round (a job ending, a wake-up, the poll) claimed
with the whole budget again while the payloads of the jobs still running stayed in memory.
Here 400 KB jobs and a 1 MB limit: at most three held (the third crosses the limit).
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import pytest

from consumer_sdk.jobs import JobContext, NewJob, accept, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.config import WorkerConfig
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import JobId, Take
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
    assert all(KB400 < job.payload_bytes < KB400 + 100 for job in got)  # as counted: the text's length
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
    """The pool passes max_payload_bytes to its claims: ten 400 KB jobs and ten free slots
    are claimed three at most a round (jobs claimed by one statement share its transaction's
    time as started_at), and all ten succeed.  Before: one round of ten."""
    enqueue(conn, [NewJob(owner_id="o1", queue="bulk", kind="big", payload=_incompressible(KB400))
                   for _ in range(10)])

    def handler(ctx: JobContext) -> int:
        return len(ctx.job.payload["blob"])

    pools({"big": handler}, max_concurrency=10, max_payload_bytes=BUDGET, poll_interval_s=0.2)
    wait_until(lambda: rows(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'")[0][0] == 10,
               timeout_s=15, message="the ten jobs did not all succeed")
    rounds = [n for (n,) in rows(jobs_db, "SELECT count(*) FROM jobs GROUP BY started_at")]
    assert sum(rounds) == 10 and max(rounds) <= 3, rounds


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "64MiB", 2**40 + 1])
def test_max_payload_bytes_is_checked(value):
    with pytest.raises(InvalidJob, match="max_payload_bytes must be an integer from 1 to"):
        WorkerConfig(dsn="postgresql://jobs@db.example/app", max_payload_bytes=value)


class Gate:
    """Handlers that block until the test releases them (or opens the gate), and how many
    ran at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running: dict[JobId, threading.Event] = {}
        self.started: list[JobId] = []
        self.most = 0
        self.opened = False
        self.failing: set[JobId] = set()

    def handler(self, ctx: JobContext) -> int:
        release = threading.Event()
        with self._lock:
            self.running[ctx.job.id] = release
            self.started.append(ctx.job.id)
            self.most = max(self.most, len(self.running))
            if self.opened:
                release.set()
        try:
            release.wait(timeout=15)
        finally:
            with self._lock:
                del self.running[ctx.job.id]
        if ctx.job.id in self.failing:
            raise RuntimeError("released to fail")
        return 0

    def release(self, n: int) -> None:
        with self._lock:
            for release in list(self.running.values())[:n]:
                release.set()

    def fail_job(self, job_id: JobId) -> None:
        """Release this job's handler to fail (its last attempt: a dead letter, no retry)."""
        with self._lock:
            self.failing.add(job_id)
            self.running[job_id].set()

    def open(self) -> None:
        with self._lock:
            self.opened = True
            for release in self.running.values():
                release.set()

    def count(self) -> int:
        with self._lock:
            return len(self.running)


def _rounds_pass(pool: Any, n: int) -> None:
    """Wake the pool's dispatcher for ``n`` rounds more (each would claim if it may)."""
    for _ in range(n):
        before = pool.rounds
        pool.wake()
        wait_until(lambda before=before: pool.rounds > before, timeout_s=5, message="the pool ran no round")


def _succeeded(jobs_db: str) -> int:
    return int(rows(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'")[0][0])


def test_a_pool_holds_at_most_its_payload_bytes_and_a_job_ending_lets_it_claim(conn, jobs_db, pools):
    """Ten 400 KB jobs, ten free slots, a 1 MB limit, handlers that block: three run (the
    third crossed the limit), and rounds after it claim nothing (before: each round claimed
    three more with the whole budget, ten ran).  A job ending frees its bytes and a round
    takes the next job at once (the poll is 30 s away); all ten succeed, three at most at once."""
    enqueue(conn, [NewJob(owner_id="o1", queue="bulk", kind="big", payload=_incompressible(KB400))
                   for _ in range(10)])
    gate, metrics = Gate(), JobsMetrics()

    def held() -> float | None:
        return metrics.registry.get_sample_value("outbox_jobs_payload_bytes_held")

    pool = pools({"big": gate.handler}, max_concurrency=10, max_payload_bytes=BUDGET, poll_interval_s=30,
                 metrics=metrics)
    try:
        wait_until(lambda: gate.count() >= 3, timeout_s=5, message="three jobs did not start")
        _rounds_pass(pool, 3)
        assert gate.count() == 3 and len(gate.started) == 3, gate.started
        assert BUDGET <= (held() or 0) < BUDGET + KB400  # what the three hold, as their claims counted
        assert metrics.registry.get_sample_value("outbox_jobs_payload_bytes_limit") == BUDGET

        gate.release(1)
        wait_until(lambda: len(gate.started) == 4, timeout_s=3,
                   message="a job ended and the pool did not claim the next before the poll")
        assert gate.count() == 3
    finally:
        gate.open()
    wait_until(lambda: _succeeded(jobs_db) == 10, timeout_s=10, message="the ten jobs did not all succeed")
    assert gate.most == 3
    wait_until(lambda: held() == 0, timeout_s=5, message="the pool still counts bytes of ended jobs")


def test_a_job_over_the_limit_runs_with_nothing_claimed_beside_it(conn, jobs_db, pools):
    """A 3 MB job and a 1 MB limit: it is claimed (a pool holding nothing always takes one)
    and, while it runs, the two small jobs behind it wait (before: the next round took them
    with the whole budget).  It ends: they run."""
    enqueue(conn, [NewJob(owner_id="h", queue="bulk", kind="huge", payload=_incompressible(3 * BUDGET))])
    enqueue(conn, [NewJob(owner_id="h", queue="bulk", kind="small", payload={"i": i}) for i in range(2)])
    gate = Gate()
    pool = pools({"huge": gate.handler, "small": lambda ctx: 0}, max_concurrency=10, max_payload_bytes=BUDGET,
                 poll_interval_s=30)
    try:
        wait_until(lambda: gate.count() == 1, timeout_s=5, message="the 3 MB job did not start")
        _rounds_pass(pool, 3)
        assert rows(jobs_db, "SELECT kind, status FROM jobs WHERE status <> 'queued'") == [("huge", "running")]
    finally:
        gate.open()
    wait_until(lambda: _succeeded(jobs_db) == 3, timeout_s=5, message="the small jobs did not run after the big one")


def test_a_job_ending_under_the_limit_wakes_a_round_even_with_one_slot_free(conn, jobs_db, pools):
    """Eight slots all taken (six small interactive jobs, two 600 KB bulk ones: 1.2 MB of a
    1 MB limit), a third 600 KB job ready.  A big one fails (its last attempt: no retry, no
    success to write, so nothing else wakes the dispatcher): one slot is free, fewer than a
    round waits for (a quarter of the slots), but the pool was waiting for memory, so the
    round comes at once and claims the third (without that wake-up: at the poll, 30 s on)."""
    enqueue(conn, [NewJob(owner_id="x", queue="interactive", kind="small", payload={"i": i}) for i in range(6)])
    enqueue(conn, [NewJob(owner_id="y", queue="bulk", kind="big", payload=_incompressible(600_000), max_attempts=1)
                   for _ in range(3)])
    gate = Gate()
    pools({"small": gate.handler, "big": gate.handler}, max_concurrency=8, max_payload_bytes=BUDGET,
          poll_interval_s=30)
    try:
        wait_until(lambda: gate.count() == 8, timeout_s=5, message=lambda: f"{gate.count()} of 8 jobs started")
        big = [i for (i,) in rows(jobs_db, "SELECT id FROM jobs WHERE kind = 'big' AND status = 'running'")]
        assert len(big) == 2
        gate.fail_job(JobId(big[0]))
        wait_until(lambda: len(gate.started) == 9, timeout_s=3,
                   message="a job ended under the limit and the pool did not claim before the poll")
    finally:
        gate.open()
    wait_until(lambda: _succeeded(jobs_db) == 8, timeout_s=5, message="the eight other jobs did not all succeed")
