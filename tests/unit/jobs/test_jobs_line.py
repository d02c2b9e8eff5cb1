"""The worker pool's line (issue 19): short jobs are claimed ahead, yet a queue's limit still
bounds the jobs that *run*, and interactive work starts first."""

from __future__ import annotations

import threading

from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.fairness import Limits, plan
from consumer_sdk.jobs.line import SHORT_JOB_S, Line
from consumer_sdk.jobs.model import ClaimedJob, JobId, Lane, Token


def _ctx(job_id: int, queue: str) -> JobContext:
    job = ClaimedJob(id=JobId(job_id), run_id=None, owner_id="o", queue=queue, kind="k", worker="w",
                     token=Token(1), attempts=1, max_attempts=3, payload=None, traceparent=None,
                     tracestate=None, wait_key=None, activation=None, created_epoch=0.0)
    return JobContext(job, deadline=0.0)


def _line(max_concurrency: int = 4, bulk_limit: int = 3) -> Line:
    return Line(queues=("interactive", "bulk"),
                limits=Limits(max_concurrency=max_concurrency, queue_limits={"bulk": bulk_limit}),
                ready=threading.Condition())


def _run(line: Line, n: int, duration_s: float) -> None:
    """n jobs through the line, each running ``duration_s``."""
    with line.ready:
        for i in range(n):
            line.add([_ctx(1000 + i, "interactive")])
            ctx = line.take()
            assert ctx is not None
            line.done(ctx, duration_s)


def test_jobs_are_claimed_ahead_only_once_they_prove_short():
    line = _line()
    assert line.depth == 0 and line.capacity == 4  # nothing measured yet: no line
    _run(line, 40, SHORT_JOB_S / 10)
    assert line.depth == 8 and line.capacity == 12 and line.total == 0
    _run(line, 40, 2.0)
    assert line.depth == 0  # long jobs again: nobody waits in this pool's line for them


def test_lined_up_bulk_jobs_never_take_the_slot_kept_for_interactive_work():
    line = _line(max_concurrency=4, bulk_limit=3)
    with line.ready:
        line.add([_ctx(i, "bulk") for i in range(6)])
        taken = [line.take() for _ in range(3)]
        assert [c.job.id for c in taken if c] == [0, 1, 2]
        assert line.running["bulk"] == 3 and line.held["bulk"] == 6
        line.add([_ctx(99, "interactive")])
        ctx = line.take()  # the fourth executor: bulk is at its limit, the interactive job may run
    assert ctx is not None and ctx.job.id == 99
    got: list[JobContext | None] = []
    fifth = threading.Thread(target=lambda: got.append(_take(line)))
    fifth.start()
    fifth.join(0.2)
    assert fifth.is_alive() and not got  # a fifth executor waits: no bulk job may start
    with line.ready:
        line.done(taken[0], 0.01)
        line.ready.notify()
    fifth.join(5)
    assert got and got[0] is not None and got[0].job.id == 3
    with line.ready:
        line.close()


def _take(line: Line) -> JobContext | None:
    with line.ready:
        return line.take()


def test_interactive_work_in_line_starts_before_bulk_work_claimed_earlier():
    line = _line(max_concurrency=4, bulk_limit=4)
    with line.ready:
        line.add([_ctx(1, "bulk"), _ctx(2, "bulk"), _ctx(3, "interactive")])
        first = line.take()
    assert first is not None and first.job.id == 3


def test_claims_ahead_keep_the_interactive_room():
    """Planned with the line's widened limits, bulk holds at most its limit plus the line's
    depth, so an interactive job is always claimable."""
    line = _line(max_concurrency=4, bulk_limit=3)
    _run(line, 40, SHORT_JOB_S / 10)
    lanes = [Lane("bulk", "big", ready=64, running=0), Lane("interactive", "small", ready=1, running=0)]
    bulk_only = plan(lanes[:1], queues=line.queues, busy={}, limits=line.ahead, last_served={})
    assert sum(t.n for t in bulk_only) == 3 + line.depth
    both = plan(lanes, queues=line.queues, busy={"bulk": 3 + line.depth}, limits=line.ahead, last_served={})
    assert [(t.queue, t.n) for t in both] == [("interactive", 1)]
