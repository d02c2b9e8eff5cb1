"""A handler that runs long: the pool's gauge and its one ``job_running_long`` line per
attempt (pure: the heartbeat's watch over fake attempts, no database)."""

from __future__ import annotations

from typing import Any

import pytest
import structlog

from consumer_sdk.jobs import WorkerConfig
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.heartbeat import Heartbeat
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import ClaimedJob, JobId, Token


def _ctx(job_id: int, queue: str, since: float | None) -> JobContext:
    job = ClaimedJob(id=JobId(job_id), run_id=None, owner_id="o", queue=queue, kind="k", worker="w",
                     token=Token(7), attempts=2, max_attempts=3, payload=None, traceparent=None,
                     tracestate=None, wait_key=None, activation=None, created_epoch=0.0)
    ctx = JobContext(job, deadline=0.0)
    ctx.running_since = since
    return ctx


def _heartbeat(running: list[JobContext], logged: list[dict[str, Any]], metrics: JobsMetrics) -> Heartbeat:
    def record(_logger: Any, _level: str, event: dict[str, Any]) -> dict[str, Any]:
        logged.append(event)
        raise structlog.DropEvent

    return Heartbeat(slot=None, worker_id="w", lease_s=30.0, max_concurrency=2,  # type: ignore[arg-type]
                     running=lambda: list(running), metrics=metrics,
                     log=structlog.wrap_logger(None, processors=[record]), clock=lambda: 0.0,
                     db_now=lambda: None, queues=("interactive", "bulk"), running_long_s=60.0)


def test_the_gauge_is_the_oldest_running_handler_of_each_queue() -> None:
    metrics = JobsMetrics()
    running = [_ctx(1, "bulk", 100.0), _ctx(2, "bulk", 40.0), _ctx(3, "bulk", None),  # lined up
               _ctx(4, "interactive", 150.0)]
    hb = _heartbeat(running, [], metrics)
    assert hb.oldest_running_s("bulk", now=160.0) == 120.0
    assert hb.oldest_running_s("interactive", now=160.0) == 10.0
    running.clear()
    assert hb.oldest_running_s("bulk", now=160.0) == 0.0
    # Exported per queue, read when scraped.
    assert metrics.registry.get_sample_value("outbox_jobs_oldest_running_age_seconds", {"queue": "bulk"}) == 0.0
    hb.close()


def test_job_running_long_is_logged_once_per_attempt_past_the_threshold() -> None:
    logged: list[dict[str, Any]] = []
    short, long = _ctx(1, "bulk", 100.0), _ctx(2, "interactive", 30.0)
    hb = _heartbeat([short, long], logged, JobsMetrics())
    assert hb.report_long(now=89.0) == 0  # 59 s: not yet
    assert hb.report_long(now=90.0) == 1
    assert hb.report_long(now=500.0) == 1  # the other one's turn; the first not again
    assert hb.report_long(now=900.0) == 0
    assert [(e["event"], e["job_id"], e["queue"], e["attempt"], e["running_s"]) for e in logged] == [
        ("job_running_long", 2, "interactive", 2, 60.0), ("job_running_long", 1, "bulk", 2, 400.0)]
    assert all(e["kind"] == "k" and e["token"] == 7 and "not returned" in e["detail"] for e in logged)
    hb.close()


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), 86_401.0, True, "600"])
def test_running_long_after_s_is_checked(value: Any) -> None:
    with pytest.raises(InvalidJob, match="running_long_after_s"):
        WorkerConfig(dsn="postgresql://localhost/db", running_long_after_s=value)


def test_running_long_after_s_defaults_to_ten_minutes() -> None:
    assert WorkerConfig(dsn="postgresql://localhost/db").running_long_after_s == 600.0


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), 86_401.0, True, "5"])
def test_handler_timeout_s_is_checked(value: Any) -> None:
    with pytest.raises(InvalidJob, match="handler_timeout_s"):
        WorkerConfig(dsn="postgresql://localhost/db", handler_timeout_s=value)


def test_handler_timeout_s_is_off_by_default() -> None:
    assert WorkerConfig(dsn="postgresql://localhost/db").handler_timeout_s is None
    assert WorkerConfig(dsn="postgresql://localhost/db", handler_timeout_s=30).handler_timeout_s == 30


def test_a_handler_times_out_only_while_it_runs_and_nothing_else_cancelled_it() -> None:
    ctx = _ctx(1, "bulk", None)
    assert not ctx.time_out()  # not started (lined up)
    ctx.running_since = 5.0
    assert ctx.time_out() and ctx.cancel_reason == "timed_out" and not ctx.time_out()
    returned = _ctx(2, "bulk", 5.0)
    returned.handler_returned()
    assert not returned.time_out() and not returned.cancelled  # returned first: its own outcome
    lost = _ctx(3, "bulk", 5.0)
    lost.cancel("lease_lost")
    assert not lost.time_out() and lost.cancel_reason == "lease_lost"
