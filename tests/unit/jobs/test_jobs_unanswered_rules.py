"""A dispatch round that hangs (:meth:`consumer_sdk.jobs.outage.Outage.in_flight`): when the pool
is not ready for it, what is logged and when, a lock wait, and a hung round that then fails
(pure: a fake clock, no database; the watching thread never ticks, the test calls ``check``)."""

from __future__ import annotations

from typing import Any

import structlog

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.outage import LOG_EVERY_S, NOT_READY_S, UNANSWERED_S, Outage

GAUGE = "outbox_jobs_database_unavailable"
TIMED_OUT = DatabaseUnavailable("database unreachable: consuming input failed: Connection timed out")
REASON = ("the database has not answered the dispatcher for {s} s (a round in flight since 1970-01-01 00:01:40 UTC, "
          "nothing claimed meanwhile): a network partition, or a server that does not answer (or a statement "
          "that runs that long)")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _outage(logged: list[dict[str, Any]], metrics: JobsMetrics,
            lock_wait: list[float] | None = None) -> tuple[Outage, Clock]:
    """``lock_wait``: what the pool's lock-wait watch found at its last look (its first item)."""
    def record(_logger: Any, level: str, event: dict[str, Any]) -> dict[str, Any]:
        logged.append({**event, "level": level})
        raise structlog.DropEvent

    clock = Clock()
    found = lock_wait if lock_wait is not None else [0.0]
    outage = Outage(log=structlog.wrap_logger(None, processors=[record]), metrics=metrics, clock=clock,
                    lock_wait_s=lambda: found[0], wall=clock, watch_every_s=3600.0)
    return outage, clock


def test_a_round_in_flight_for_the_threshold_makes_the_pool_not_ready_logs_once_and_its_return_ends_it() -> None:
    logged: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    outage, clock = _outage(logged, metrics)
    with outage.in_flight(clock.now):
        clock.now += UNANSWERED_S - 0.1  # a slow round, not yet an unanswered one
        outage.check()
        assert outage.reason() is None and metrics.registry.get_sample_value(GAUGE) == 0.0 and not logged
        clock.now += 0.1
        assert outage.reason() == REASON.format(s=10)
        assert metrics.registry.get_sample_value(GAUGE) == 1.0
        outage.check()
        outage.check()
        assert [(e["event"], e["level"], e["unanswered_s"]) for e in logged] == [("dispatch_unanswered", "warning", 10.0)]
        assert logged[0]["detail"] == REASON.format(s=10) and logged[0]["since"] == "1970-01-01 00:01:40 UTC"
        clock.now += LOG_EVERY_S - 1  # still hanging: said again every LOG_EVERY_S, no sooner
        outage.check()
        assert len(logged) == 1
        clock.now += 1
        outage.check()
        assert [e["unanswered_s"] for e in logged] == [10.0, 40.0]
    outage.passed()
    assert logged[-1] == {"event": "dispatch_recovered", "level": "info", "rounds": 0, "failed_s": 40.0,
                          "unanswered_s": 40.0, "error": "no answer from the database", "error_type": "Unanswered"}
    assert outage.reason() is None and metrics.registry.get_sample_value(GAUGE) == 0.0
    with outage.in_flight(clock.now):  # the next round returns at once: nothing to say
        clock.now += 0.01
    outage.passed()
    assert len(logged) == 3


def test_a_lock_wait_the_pools_watch_found_keeps_the_pool_ready() -> None:
    # The lock-wait watch found the pool's session waiting on a lock: the database answers.
    logged: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    found = [0.0]
    outage, clock = _outage(logged, metrics, found)
    with outage.in_flight(clock.now):
        clock.now += 7.0
        found[0] = 6.5
        clock.now += 60.0
        outage.check()
        assert outage.reason() is None and metrics.registry.get_sample_value(GAUGE) == 0.0 and not logged
        found[0] = 0.0  # the watch's next look: no lock wait any more
        assert outage.reason() == REASON.format(s=67)
    outage.passed()


def test_a_round_that_hung_then_failed_keeps_the_pool_not_ready_without_a_second_round() -> None:
    # TCP gave up (tcp_user_timeout): the round fails with its own error.  One failed round is
    # a blip as a rule, but this one was an outage already: no flapping back to ready.
    logged: list[dict[str, Any]] = []
    metrics = JobsMetrics()
    outage, clock = _outage(logged, metrics)
    began = clock.now
    with outage.in_flight(began):
        clock.now += 30.0
        outage.check()
        clock.now += 0.5  # the round failed (the exception leaves the with block)
    outage.failed(TIMED_OUT, began=began)
    assert outage.failed_rounds == 1
    assert outage.reason() == ("the database is unavailable (stopped, unreachable, or refusing connections) for 30 s "
                               "(1 dispatch rounds failed in a row, nothing claimed meanwhile): " + str(TIMED_OUT))
    with outage.in_flight(clock.now):  # connecting again, into the partition
        clock.now += NOT_READY_S
        assert outage.reason() is not None and metrics.registry.get_sample_value(GAUGE) == 1.0
    outage.passed()
    assert [e["event"] for e in logged] == ["dispatch_unanswered", "dispatch_failed", "dispatch_recovered"]
    assert outage.reason() is None


def test_a_round_in_flight_after_a_failed_one_counts_as_failed_after_two_seconds() -> None:
    logged: list[dict[str, Any]] = []
    outage, clock = _outage(logged, JobsMetrics())
    began = clock.now
    with outage.in_flight(began):
        clock.now += 0.1
    outage.failed(TIMED_OUT, began=began)  # one failed round: a blip so far
    with outage.in_flight(clock.now):
        clock.now += NOT_READY_S - 0.2
        assert outage.reason() is None
        clock.now += 0.2  # the reconnect hangs: two rounds, two seconds
        reason = outage.reason()
        assert reason is not None and reason.startswith("the database is unavailable"), reason
    outage.passed()
    assert outage.reason() is None


def test_close_ends_the_watch_and_the_round() -> None:
    metrics = JobsMetrics()
    outage = Outage(log=structlog.get_logger(), metrics=metrics, clock=Clock(), watch_every_s=0.01)
    with outage.in_flight(0.0):
        watch = outage._watch
        assert watch is not None and watch.is_alive()
    outage.close()
    watch.join(5)
    assert not watch.is_alive() and outage.reason() is None


def test_the_threshold_is_the_one_the_fault_test_waits_for() -> None:
    assert UNANSWERED_S == 10.0  # tests/faults/test_jobs_unanswered.py: UNANSWERED_S
