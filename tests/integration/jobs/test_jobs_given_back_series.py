"""outbox_jobs_given_back_total has every cause's series at 0 for each queue a worker pool
serves from its start (as the relay's counters): a series that first appears at 1 is no
increase() to Prometheus, and OutboxJobsGivenBack missed the first give-backs of a process."""

from __future__ import annotations

from consumer_sdk.jobs import JobsMetrics, WorkerConfig, WorkerPool

CAUSES = ("connection_broke", "conflict", "read_only", "prepared_statement_lost", "interruptions_exhausted")


def test_every_give_back_cause_is_at_0_once_the_pool_started(jobs_db: str) -> None:
    metrics = JobsMetrics()
    config = WorkerConfig(dsn=jobs_db, max_concurrency=1, queues=("interactive", "bulk"), poll_interval_s=5.0,
                          listen=False, drain_timeout_s=1.0)
    pool = WorkerPool(config, {"work": lambda ctx: None}, metrics=metrics)
    assert metrics.registry.get_sample_value("outbox_jobs_given_back_total",
                                             {"queue": "bulk", "cause": "conflict"}) is None
    pool.start()
    try:
        for queue in ("interactive", "bulk"):
            for cause in CAUSES:
                assert metrics.registry.get_sample_value(
                    "outbox_jobs_given_back_total", {"queue": queue, "cause": cause}) == 0.0, (queue, cause)
    finally:
        pool.stop()
