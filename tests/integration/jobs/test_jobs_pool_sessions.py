"""The worker pool's own sessions (consumer_sdk/jobs/_conn.py; real PostgreSQL): the lock-wait
watch's connection named apart from the pool's working connections (``:watch``)."""

from __future__ import annotations

from consumer_sdk.jobs import WorkerConfig, WorkerPool


def test_the_lock_wait_watch_connects_as_the_pool_with_watch(jobs_db) -> None:
    name = "t-" + "w" * 61  # 63 characters: cut so that the suffix stays
    pool = WorkerPool(WorkerConfig(dsn=jobs_db, listen=False, application_name=name), {"k": lambda ctx: None})
    watch = pool.lock_waits._connect()  # the factory of the watch's own connection (opened when it looks)
    try:
        found = watch.execute("SELECT a.application_name FROM pg_stat_activity AS a "
                              "WHERE a.pid = pg_backend_pid()").fetchall()
        assert found == [(name[:57] + ":watch",)], found
    finally:
        watch.close()
        pool.stop()
