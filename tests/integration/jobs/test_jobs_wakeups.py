"""Wake-ups: LISTEN/NOTIFY, relayed Kafka events through the dedup consumer, and the slow poll
as the safety net.  Each test makes the other paths slow (a 30 s poll) so only the one under
test can explain a prompt start."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from consumer_sdk import InboxConsumer, write_event
from consumer_sdk.jobs import (
    JobContext,
    WaitFor,
    WorkerConfig,
    WorkerPool,
    accept,
    activate,
    activation_handler,
    wake_handler,
)
from tests.fixtures.broker import create_topic
from tests.fixtures.outbox import RelayThread
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import job_status, migrate_jobs_db
from tests.integration.sdk._support import ConsumerThread, make_config

SLOW_S = 30.0


def _recorder(started: dict[int, float]) -> dict[str, Any]:
    def work(ctx: JobContext) -> Any:
        started[ctx.job.id] = time.monotonic()
        if ctx.payload.get("wait") and ctx.job.wait_key is None:
            return WaitFor(ctx.payload["wait"], "approval")
        return ctx.activation

    return {"work": work}


def _idle(pool: Any) -> None:
    """Wait until the pool finished a dispatch round, so the next one is SLOW_S away."""
    rounds = pool.rounds
    wait_until(lambda: pool.rounds > rounds or pool.rounds > 0, timeout_s=10)


def _started_within(started: dict[int, float], job_id: int, since: float, limit_s: float) -> float:
    wait_until(lambda: job_id in started, timeout_s=limit_s + 5, message=f"job {job_id} never started")
    took = started[job_id] - since
    assert took < limit_s, f"job {job_id} started after {took:.2f}s"
    return took


def test_notify_wakes_the_pool_on_insert_and_on_resume(conn, pools):
    started: dict[int, float] = {}
    pool = pools(_recorder(started), poll_interval_s=SLOW_S, reconcile_interval_s=SLOW_S)
    wait_until(lambda: pool.listening, timeout_s=10)
    _idle(pool)
    t0 = time.monotonic()
    run = accept(conn, owner_id="o", request_key="k", kind="work", body={"wait": "approval:1"})
    _started_within(started, run.job_id, t0, 3.0)
    wait_until(lambda: job_status(conn.info.dsn, run.job_id) == "waiting", timeout_s=5)
    del started[run.job_id]
    t1 = time.monotonic()
    activate(conn, "approval:1", {"ok": True})  # the requeue trigger notifies
    _started_within(started, run.job_id, t1, 3.0)


def test_losing_every_wake_up_delays_work_by_at_most_the_poll_interval(conn, pools):
    started: dict[int, float] = {}
    pool = pools(_recorder(started), listen=False, poll_interval_s=1.0, reconcile_interval_s=SLOW_S)
    _idle(pool)
    t0 = time.monotonic()
    run = accept(conn, owner_id="o", request_key="k", kind="work", body={})
    _started_within(started, run.job_id, t0, 1.0 + 1.5)


def test_relayed_kafka_events_wake_the_pool_and_activate_waiting_jobs(
        own_db_dsn: str, broker: Any, topic_name: Callable[[str], str]) -> None:
    """accept writes run.accepted to the outbox; the relay publishes it; the dedup consumer's
    wake handler wakes the pool.  An approval event activates the waiting job in the
    consumer's transaction (exactly once, with its inbox row) and writes job.resumed,
    whose relayed copy wakes the pool after that transaction committed.

    On this session's own embedded server: the relay publishes only rows older than every
    transaction in flight on the whole server, which a shared server cannot promise."""
    dsn = migrate_jobs_db(own_db_dsn)
    events, approvals = topic_name("runs"), topic_name("approvals")
    for topic in (events, approvals):
        create_topic(broker.bootstrap, topic, partitions=1)
        create_topic(broker.bootstrap, f"{topic}.dlq", partitions=1)  # checked at the consumer's start
    started: dict[int, float] = {}
    pool = WorkerPool(WorkerConfig(dsn=dsn, listen=False, poll_interval_s=SLOW_S,
                                   reconcile_interval_s=SLOW_S, drain_timeout_s=1.0), _recorder(started))

    def approval_key(message: Any) -> str | None:
        return message.json()["key"] if message.topic == approvals else None

    handler = wake_handler(pool, then=activation_handler(approval_key, events_topic=events))
    consumer = ConsumerThread(_consumer(dsn, broker, [events, approvals], handler)).start()
    relay = RelayThread(dsn, broker.bootstrap, poll_interval_s=0.1).start()
    pool.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            _idle(pool)
            t0 = time.monotonic()
            run = accept(conn, owner_id="o", request_key="k", kind="work", body={"wait": "approval:7"},
                         events_topic=events)
            _started_within(started, run.job_id, t0, 10.0)
            wait_until(lambda: job_status(dsn, run.job_id) == "waiting", timeout_s=10)
            del started[run.job_id]
            with conn.transaction():
                write_event(conn, topic=approvals, key="approval:7", payload={"key": "approval:7", "ok": True})
            wait_until(lambda: job_status(dsn, run.job_id) == "succeeded", timeout_s=20,
                       message=lambda: f"job status {job_status(dsn, run.job_id)}")
            assert pool.rounds < 20  # woken by events, not polling
            assert conn.execute("SELECT count(*) FROM job_activations").fetchone() == (1,)
    finally:
        pool.stop(drain_timeout_s=1.0)
        relay.stop()
        consumer.stop()


def _consumer(dsn: str, broker: Any, topics: list[str], handler: Any) -> Any:
    config = make_config(dsn, broker, topics[0], topics=topics, check_retention=False)
    return InboxConsumer(config, handler)
