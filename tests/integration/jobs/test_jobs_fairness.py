"""Test 3 of the issue: 10,000 bulk jobs of one owner do not starve one interactive job of
another owner, nor one bulk job of another owner; per-owner limits hold across pools."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from consumer_sdk.jobs import JobContext, NewJob, accept, enqueue
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs._db import q
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import scalar

BACKLOG = 10_000


def _backlog(conn: Any, owner: str = "big-tenant") -> None:
    enqueue(conn, [NewJob(owner_id=owner, queue="bulk", kind="bulk", payload={"i": i})
                   for i in range(BACKLOG)])


def _handlers(started: dict[str, float]) -> dict[str, Any]:
    def bulk(ctx: JobContext) -> Any:
        ctx.sleep(0.02)

    def small(ctx: JobContext) -> Any:
        started[ctx.job.owner_id] = time.monotonic()

    return {"bulk": bulk, "small": small}


def test_one_interactive_job_starts_within_seconds_behind_10000_bulk_jobs(conn, pools, jobs_db):
    _backlog(conn)
    started: dict[str, float] = {}
    pools(_handlers(started), max_concurrency=4, queue_limits={"bulk": 3}, poll_interval_s=2.0)
    wait_until(lambda: scalar(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'") >= 20,
               timeout_s=20, message="the bulk backlog is not being worked")
    accepted_at = time.monotonic()
    accept(conn, owner_id="small-tenant", request_key="one", kind="small", body={})
    wait_until(lambda: "small-tenant" in started, timeout_s=10, message="the interactive job never started")
    print(f"interactive job started {started['small-tenant'] - accepted_at:.3f}s after accept")
    assert started["small-tenant"] - accepted_at < 3.0
    assert scalar(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'queued'") > BACKLOG / 2


def test_one_bulk_job_of_another_owner_is_not_starved_by_10000(conn, pools, jobs_db):
    _backlog(conn)
    started: dict[str, float] = {}
    pools(_handlers(started), max_concurrency=3, queues=("bulk",), poll_interval_s=2.0)
    wait_until(lambda: scalar(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'") >= 20,
               timeout_s=20, message="the bulk backlog is not being worked")
    accepted_at = time.monotonic()
    accept(conn, owner_id="small-tenant", request_key="one", kind="small", body={}, queue="bulk")
    wait_until(lambda: "small-tenant" in started, timeout_s=10, message="the small tenant was starved")
    print(f"small tenant's bulk job started {started['small-tenant'] - accepted_at:.3f}s after accept")
    assert started["small-tenant"] - accepted_at < 3.0


def test_the_owner_limit_holds_across_pools(conn, pools, jobs_db):
    """Two pools with 4 slots each; owner limit 2: never more than 2 of one owner at once."""
    running: dict[str, int] = {}
    peak: dict[str, int] = {}
    lock = threading.Lock()

    def hold(ctx: JobContext) -> Any:
        owner = ctx.job.owner_id
        with lock:
            running[owner] = running.get(owner, 0) + 1
            peak[owner] = max(peak.get(owner, 0), running[owner])
        try:
            ctx.sleep(0.03)
        finally:
            with lock:
                running[owner] -= 1

    owners = ["t1", "t2", "t3"]
    enqueue(conn, [NewJob(owner_id=o, queue="bulk", kind="hold", payload={}) for o in owners
                   for _ in range(30)])
    for _ in range(2):
        pools({"hold": hold}, max_concurrency=4, owner_limit=2, poll_interval_s=0.2)
    wait_until(lambda: scalar(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'") == 90,
               timeout_s=40, message="not all jobs completed")
    assert max(peak.values()) == 2, peak  # reached, never exceeded


def test_an_owner_at_its_limit_gets_the_freed_slot_without_waiting_for_a_poll(conn, pools, jobs_db):
    """One owner, limit 1, 12 jobs, polls and reconciles every 30 s: each job's completion
    must lead straight to the claim of the next (the owner's running count seen by the
    round that wrote the completion still included it), not to a wait for the poll."""
    enqueue(conn, [NewJob(owner_id="limited", queue="bulk", kind="small", payload={"i": i})
                   for i in range(12)])
    started: dict[str, float] = {}
    pools(_handlers(started), max_concurrency=3, owner_limit=1, poll_interval_s=30.0,
          reconcile_interval_s=30.0, listen=False)
    wait_until(lambda: scalar(jobs_db, "SELECT count(*) FROM jobs WHERE status = 'succeeded'") == 12,
               timeout_s=20, message="the limited owner's next job waited for a poll")


def _owners(lanes: list[Any], queue: str = "bulk") -> list[str]:
    return [lane.owner_id for lane in lanes if lane.queue == queue]


def test_a_read_of_the_lanes_starts_after_the_owner_served_last_and_wraps_around(conn, jobs_db):
    """With more ready owners than max_owners_per_round, the lanes were cut in owner_id order:
    the owners after the first ones were never listed while those had work (an audit of the
    pool).  Now each queue's list starts after its cursor and wraps, by index ranges only."""
    enqueue(conn, [NewJob(owner_id=f"o{i:02d}", queue="bulk", kind="k", payload={}) for i in range(12)]
            + [NewJob(owner_id=f"o{i:02d}", queue="interactive", kind="k", payload={}) for i in range(3)])
    read = functools.partial(jobq.ready_lanes, conn, queues=["interactive", "bulk"], max_owners=5)
    assert _owners(read()) == ["o00", "o01", "o02", "o03", "o04"]
    assert _owners(read(after={"bulk": "o04"})) == ["o05", "o06", "o07", "o08", "o09"]
    wrapped = read(after={"bulk": "o09"})
    assert _owners(wrapped) == ["o10", "o11", "o00", "o01", "o02"]
    assert _owners(wrapped, "interactive") == ["o00", "o01", "o02"]  # each queue its own cursor
    assert _owners(read(after={"bulk": "o045"})) == ["o05", "o06", "o07", "o08", "o09"]  # gone owners too
    assert _owners(read(after={"bulk": "o11"})) == ["o00", "o01", "o02", "o03", "o04"]
    assert _owners(read(after={"bulk": "zz"}, max_owners=50)) == [f"o{i:02d}" for i in range(12)]
    # Every owner is listed within ceil(owners / max_owners) reads when each read's are served.
    seen: set[str] = set()
    after: dict[str, str] = {}
    for _ in range(3):
        listed = _owners(read(after=after))
        seen |= set(listed)
        after["bulk"] = listed[-1]
    assert seen == {f"o{i:02d}" for i in range(12)}
    plan = "\n".join(r[0] for r in conn.execute(
        "EXPLAIN ANALYZE " + q("ready_lanes"),
        {"queues": ["bulk"], "after": ["o05"], "max_owners": 5, "count_cap": 64, "now": None}).fetchall())
    assert "Seq Scan on jobs" not in plan, plan


def test_an_owner_behind_more_owners_than_a_round_lists_is_served_in_turn(conn, pools, jobs_db):
    """520 tenants with 10 jobs each and max_owners_per_round=500: a tenant after them in
    owner_id order started after 5,119 of their 5,200 jobs (an audit of the pool).  Here 30
    tenants of 5 jobs and 5 owners a round: the late tenant waits for about one job of
    each other tenant (one turn), not for their work to run out (before: 130 or more)."""
    owners = 30
    enqueue(conn, [NewJob(owner_id=f"a{o:02d}", queue="bulk", kind="bulk", payload={})
                   for _ in range(5) for o in range(owners)])
    enqueue(conn, [NewJob(owner_id="zz-late-tenant", queue="bulk", kind="late", payload={})])
    lock = threading.Lock()
    seen = {"others": 0, "late_after": -1}

    def other(ctx: JobContext) -> None:
        with lock:
            seen["others"] += 1

    def late(ctx: JobContext) -> None:
        with lock:
            seen["late_after"] = seen["others"]

    pools({"bulk": other, "late": late}, max_concurrency=2, queues=("bulk",), max_owners_per_round=5,
          poll_interval_s=0.5)
    wait_until(lambda: seen["late_after"] >= 0, timeout_s=60, message="the late tenant never started")
    print(f"late tenant started after {seen['late_after']} of {owners * 5} other jobs")
    assert seen["late_after"] <= 2 * (owners + 1)
