"""A worker pool's one watching thread (:meth:`consumer_sdk.jobs.lock_waits.PoolLockWaitWatch.tick_also`):
the lock-wait watch's thread also ticks the outage's round in flight (:mod:`consumer_sdk.jobs.outage`);
a pool ran a thread for each before (no database: a connection factory that hangs or fails)."""

from __future__ import annotations

import threading
from typing import Any

import structlog

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs import WorkerConfig, WorkerPool
from consumer_sdk.jobs.outage import UNANSWERED_S
from tests.fixtures.procs import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_running_pool_has_one_watching_thread_which_also_says_a_round_went_unanswered() -> None:
    logged: list[dict[str, Any]] = []
    release = threading.Event()

    def connect() -> Any:  # the dispatcher's round hangs in it (a partition); any other caller is refused
        if threading.current_thread().name == "jobs-dispatch":
            release.wait(30)
        raise DatabaseUnavailable("database unreachable: connection refused")

    def record(_logger: Any, _level: str, event: dict[str, Any]) -> dict[str, Any]:
        logged.append(event)
        raise structlog.DropEvent

    clock = Clock()
    pool = WorkerPool(WorkerConfig(dsn="postgresql://app@db/app", max_concurrency=1, listen=False),
                      {"k": lambda ctx: None}, connect=connect, clock=clock,
                      log=structlog.wrap_logger(None, processors=[record]))
    before = set(threading.enumerate())
    pool.start()
    try:
        wait_until(lambda: pool.health().ready, timeout_s=5, message="the pool never started")
        wait_until(lambda: pool._outage._flight is not None, timeout_s=5, message="no round in flight")
        clock.now += UNANSWERED_S + 1
        wait_until(lambda: any(e["event"] == "dispatch_unanswered" for e in logged), timeout_s=5,
                   message=lambda: f"the round in flight was not watched: {logged}")
        started = sorted(t.name for t in threading.enumerate() if t not in before)
        assert started == ["jobs-dispatch", "jobs-exec-0", "jobs-heartbeat", "jobs-lease-watch", "jobs-watch"], started
    finally:
        release.set()
        pool.stop(drain_timeout_s=0.5)
