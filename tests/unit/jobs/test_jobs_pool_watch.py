"""A worker pool's two watches run on two threads: the lock-wait watch
(:mod:`consumer_sdk.jobs.lock_waits`, ``jobs-lock-waits``) and the outage's look at the round
in flight (:mod:`consumer_sdk.jobs.outage`, ``jobs-dispatch-watch``).  The first waits on the
database (its connect, its statement); in a partition the second's ``dispatch_unanswered``
must not wait behind it (no database: a connection factory that hangs)."""

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


def test_a_round_unanswered_is_said_while_the_lock_wait_look_hangs_too() -> None:
    logged: list[dict[str, Any]] = []
    release = threading.Event()
    hanging: set[str] = set()

    def connect() -> Any:  # a partition: the dispatcher's round hangs in it
        if threading.current_thread().name == "jobs-dispatch":
            hanging.add("round")
            release.wait(30)
        raise DatabaseUnavailable("database unreachable: connection refused")

    def look() -> tuple[()]:  # and so does the lock-wait watch's look (its connect or its statement)
        hanging.add("look")
        release.wait(30)
        return ()

    def record(_logger: Any, _level: str, event: dict[str, Any]) -> dict[str, Any]:
        logged.append(event)
        raise structlog.DropEvent

    clock = Clock()
    pool = WorkerPool(WorkerConfig(dsn="postgresql://app@db/app", max_concurrency=1, listen=False),
                      {"k": lambda ctx: None}, connect=connect, clock=clock,
                      log=structlog.wrap_logger(None, processors=[record]))
    pool.lock_waits.held_up_s = lambda: 60.0  # type: ignore[method-assign]  # it looks...
    pool.lock_waits._look = look  # type: ignore[method-assign]  # ... and the look hangs
    before = set(threading.enumerate())
    pool.start()
    try:
        wait_until(lambda: hanging == {"round", "look"}, timeout_s=10,
                   message=lambda: f"the round and the look should both hang: {hanging}")
        clock.now += UNANSWERED_S + 1
        wait_until(lambda: any(e["event"] == "dispatch_unanswered" for e in logged), timeout_s=5,
                   message=lambda: f"the round unanswered waited behind the lock-wait look: {logged}")
        started = sorted(t.name for t in threading.enumerate() if t not in before)
        assert {"jobs-dispatch-watch", "jobs-lock-waits"} <= set(started), started
    finally:
        release.set()
        pool.stop(drain_timeout_s=0.5)
