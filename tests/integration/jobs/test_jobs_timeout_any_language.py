"""The pool's own statement_timeout told under any ``lc_messages`` (consumer_sdk/jobs/statement_clock.py;
real PostgreSQL).

The machine has no translated locale to run the server in, so a trigger stands in for
another language: it lets the real ``statement_timeout`` (the pool's, 0.3 s) cancel its
sleep, catches that cancel and raises it again with its SQLSTATE (57014) and German words.
Before the clock, only the English words told a timeout: the round failed as "database
unavailable".  A 57014 raised at once, long before the timeout (what a cancel request does),
must stay a plain DatabaseUnavailable.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from consumer_sdk.jobs.errors import StatementTimedOut
from tests.integration.jobs._support import rows

#: The claim's UPDATE sleeps past the pool's timeout; its cancel comes back in German.
TIMED_OUT_IN_GERMAN = """
CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(10);
    RETURN NEW;
EXCEPTION WHEN query_canceled THEN
    RAISE query_canceled USING MESSAGE = 'Abbruch der Anweisung wegen Zeitüberschreitung';
END $$;
CREATE TRIGGER slow_claim BEFORE UPDATE ON jobs FOR EACH ROW
    WHEN (OLD.status = 'queued' AND NEW.status = 'running') EXECUTE FUNCTION slow_claim();
"""
#: A 57014 at once, as a cancel request's (re-raised with the same German words): the words
#: are not what tells the timeout.
CANCELLED_AT_ONCE = TIMED_OUT_IN_GERMAN.replace("PERFORM pg_sleep(10);", "RAISE query_canceled;")


def _claim_round(conn: psycopg.Connection[Any], jobs_db: str, trigger: str) -> Exception:
    conn.execute(trigger)
    [job] = enqueue(conn, [NewJob(owner_id="o", queue="q", kind="k", payload={})])
    config = WorkerConfig(dsn=jobs_db, queues=("q",), max_concurrency=1, listen=False, pool_statement_timeout_s=0.3)
    pool = WorkerPool(config, {"k": lambda ctx: None})
    try:
        with pytest.raises(DatabaseUnavailable) as raised:
            pool.run_once()
    finally:
        pool.stop(drain_timeout_s=0.5)
    assert rows(jobs_db, "SELECT status, attempts FROM jobs WHERE id = %s", (job,)) == [("queued", 0)]
    return raised.value


def test_a_claim_cancelled_by_the_pools_timeout_in_german_is_a_statement_timeout(conn, jobs_db) -> None:
    error = _claim_round(conn, jobs_db, TIMED_OUT_IN_GERMAN)
    assert isinstance(error, StatementTimedOut), repr(error)
    assert "Zeitüberschreitung" in str(error) and "pool_statement_timeout_s" in str(error)


def test_a_cancel_long_before_the_pools_timeout_stays_database_unavailable(conn, jobs_db) -> None:
    error = _claim_round(conn, jobs_db, CANCELLED_AT_ONCE)
    assert not isinstance(error, StatementTimedOut), repr(error)
    assert str(error) == "database unavailable: Abbruch der Anweisung wegen Zeitüberschreitung", str(error)
