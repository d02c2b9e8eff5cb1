"""A handler that catches the database's error and returns is retried, whichever way it ran
its statement (real PostgreSQL, real broker).

The handler's transaction is aborted all the same when it catches a conflict (class 40) or
a read-only database (25006) and returns; the store must know that the database did it, to
retry the batch with the database back-off instead of counting an attempt of the retry
policy (``HandlerTransactionFailed``, dead-lettered after the policy's attempts).  The
store saw only ``execute`` and ``executemany`` (test_sdk_handler_database_errors.py); here
each other way a handler can run a statement on its connection meets the fault and is
caught: ``cursor.copy()`` (the error comes at the copy's end), ``cursor.stream()`` (from
the generator), a pipeline (at its end, with a statement after the failing one that the
server skips: psycopg's ``PipelineAborted`` must not hide the error; at its ``sync()``,
caught there, its end then going through) and a server-side cursor (``conn.cursor(name=...)``,
at its fetch).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql
from structlog.testing import capture_logs

from consumer_sdk import InboxMessage, RetryPolicy
from tests.integration.sdk._support import effect_counts, make_config, produce_raw, wait_settled

#: How many of the handler's statements meet the fault before the database is back.
FAULTS = 2
EVENTS = 4
RETRY = RetryPolicy(max_attempts=2, backoff_initial_s=0.05, backoff_max_s=0.1)

#: ``faulty()``: its first FAULTS calls raise a server error (SQLSTATE ``errcode``), counted
#: in a sequence (not rolled back with the transaction), then it answers 1.  With ``trigger``
#: it is called for each row inserted into the handler's table.
_FAULT_DDL = """
CREATE SEQUENCE faults;
CREATE FUNCTION faulty() RETURNS int LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF nextval('faults') <= {faults} THEN
        RAISE EXCEPTION '% under the handler', {errcode} USING ERRCODE = {errcode};
    END IF;
    RETURN 1;
END $$;
CREATE FUNCTION faulty_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM faulty();
    RETURN NEW;
END $$;
"""
_TRIGGER_DDL = "CREATE TRIGGER faulty_row BEFORE INSERT ON effects FOR EACH ROW EXECUTE FUNCTION faulty_row()"
_INSERT = "INSERT INTO effects (event_id, consumer, n) VALUES (%s, 'c', %s)"


def _params(message: InboxMessage) -> tuple[Any, ...]:
    return (message.event_id, message.json()["n"])


def _copy(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
    with conn.cursor() as cur, cur.copy("COPY effects (event_id, consumer, n) FROM STDIN") as copy:
        copy.write_row((message.event_id, "c", message.json()["n"]))


def _stream(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
    with conn.cursor() as cur:
        assert [row[0] for row in cur.stream(_INSERT + " RETURNING n", _params(message))] == [message.json()["n"]]


def _pipeline(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
    with conn.pipeline():
        conn.execute(_INSERT, _params(message))
        conn.execute("SELECT 1")  # skipped by the server once the INSERT failed


def _pipeline_sync(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
    with conn.pipeline() as pipeline:
        conn.execute(_INSERT, _params(message))
        try:
            pipeline.sync()  # the error comes here; the pipeline's end then goes through
        except psycopg.Error:
            pass  # the handler's bug: its transaction is aborted all the same


def _server_cursor(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
    with conn.cursor(name="faulty") as cur:
        cur.execute("SELECT faulty()")
        assert cur.fetchall() == [(1,)]
    conn.execute(_INSERT, _params(message))


def _faults(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT last_value, is_called FROM faults").fetchone()
    assert row is not None
    return int(row[0]) if row[1] else 0


@pytest.mark.parametrize(("path", "errcode"), [
    (_copy, "serialization_failure"),
    (_stream, "read_only_sql_transaction"),
    (_pipeline, "serialization_failure"),
    (_pipeline_sync, "deadlock_detected"),
    (_server_cursor, "deadlock_detected"),
], ids=["copy", "stream", "pipeline", "pipeline_sync", "server_cursor"])
def test_a_handler_that_catches_the_databases_error_is_retried_whatever_ran_the_statement(
        sdk_db: str, broker: Any, sdk_topic: str, run_consumer: Any,
        path: Callable[[psycopg.Connection[Any], InboxMessage], None], errcode: str) -> None:
    """Every effect once, nothing dead-lettered, no handler attempt counted: the batch was
    retried as for the database (TransactionConflict; the read-only wait).  Before, the
    handler's transaction failed with HandlerTransactionFailed, an attempt of the policy,
    and the first record was dead-lettered after its two."""
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        conn.execute(sql.SQL(_FAULT_DDL).format(faults=sql.Literal(FAULTS), errcode=sql.Literal(errcode)))
        if path is not _server_cursor:
            conn.execute(_TRIGGER_DDL)
    ids = [str(uuid.uuid4()) for _ in range(EVENTS)]
    produce_raw(broker.bootstrap, sdk_topic, [(b"k", f'{{"n": {n}}}'.encode(), [("event_id", i.encode())])
                                              for n, i in enumerate(ids)])

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        try:
            path(conn, message)
        except psycopg.Error:
            return  # the handler's bug: its transaction is aborted all the same

    config = make_config(sdk_db, broker, sdk_topic, check_retention=False, retry=RETRY,
                         db_backoff_initial_s=0.05, db_backoff_max_s=0.2)
    with capture_logs() as logs:
        thread = run_consumer(config, handler)
        wait_settled(thread, len(ids))
        thread.stop()

    assert [e for e in logs if e["event"] in ("handler_failed", "message_dead_lettered")] == []
    assert thread.sample("outbox_consumer_handler_errors_total", consumer=config.name, topic=sdk_topic) == 0
    assert thread.consumer.totals.dead_lettered == 0
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) and set(effects.values()) == {1}
    retried = [e for e in logs if e["event"] == "batch_retrying"]
    read_only = errcode == "read_only_sql_transaction"
    assert retried and {e["error_type"] for e in retried} == {
        "DatabaseUnavailable" if read_only else "TransactionConflict"}
    assert all(e["error"].startswith("the database is read-only (a standby, or a failover in progress)" if read_only
                                     else f"transaction aborted: {errcode} under the handler") for e in retried)
    assert _faults(sdk_db) > FAULTS  # every fault was met, then the statements went through
