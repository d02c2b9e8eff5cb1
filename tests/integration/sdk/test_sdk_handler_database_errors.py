"""The database failing under the handler's own statements (real PostgreSQL, real broker).

The handler runs its statements on the consumer's connection, inside the consumer's
transaction.  When what fails there is the database, not the message or the handler (the
session ended: ``pg_terminate_backend``, 57P01; the database read-only: 25006, a failover),
the batch must be retried whole with the database back-off, like the SDK's own statement
meeting the same error: no handler attempt counted, never dead-lettered for it.  Before,
the error was the handler's failure (``handler_failed``, an attempt of the retry policy),
and after the policy's attempts the record was dead-lettered.

A transaction cannot turn read-only after its first write (the inbox row comes first), so a
handler meets 25006 where the consumer's own claim does not through a table of another
server (a foreign table, a proxy): here a trigger on the handler's table raises the
server's ``read_only_sql_transaction`` for its first few rows, then lets them through.

A transaction the server aborted to resolve a conflict (class 40: a serialization failure,
a deadlock) is no fault of the message either: PostgreSQL asks the client to run the
transaction again.  It is retried whole with the database back-off, as the consumer's own
COMMIT meeting the same error is (``TransactionConflict``), no attempt counted.  Before,
the handler's statement meeting it was the handler's failure, and a message on a contended
row was dead-lettered after the policy's attempts.

An error that is the handler's own business (a constraint it violates, its statement
cancelled by its own ``statement_timeout``: an OperationalError that is not about
availability) is still judged by the retry policy.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql
from structlog.testing import capture_logs

from consumer_sdk import RetryPolicy
from tests.integration.sdk._support import (
    effect_counts,
    make_config,
    produce_raw,
    record_effect,
    wait_for,
    wait_settled,
)

#: How many of the handler's statements meet the fault before the database is back.
FAULTS = 3
RETRY = RetryPolicy(max_attempts=2, backoff_initial_s=0.05, backoff_max_s=0.1)

#: A trigger on the handler's table: its first FAULTS rows meet a server error (SQLSTATE
#: ``errcode``, the server's ``message``), counted in a sequence of the trigger's name (not
#: rolled back with the transaction: see _faults), then the rows go through.
_FAULT_DDL = """
CREATE SEQUENCE {name};
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF nextval({sequence}) <= {faults} THEN
        RAISE EXCEPTION {message} USING ERRCODE = {errcode};
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER {name} BEFORE INSERT ON effects FOR EACH ROW EXECUTE FUNCTION {name}();
"""


def _fault_first_rows(dsn: str, name: str, *, errcode: str, message: str) -> None:
    """Install the trigger ``name`` (_FAULT_DDL) on the handler's table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(_FAULT_DDL).format(name=sql.Identifier(name), sequence=sql.Literal(name),
                                                faults=sql.Literal(FAULTS), message=sql.Literal(message),
                                                errcode=sql.Literal(errcode)))


_INSERT = "INSERT INTO effects (event_id, consumer, n) VALUES (%s, 'c', %s)"


def _events(count: int) -> tuple[list[str], list[tuple[bytes, bytes, list[tuple[str, bytes]]]]]:
    ids = [str(uuid.uuid4()) for _ in range(count)]
    records = [(b"k", f'{{"n": {n}}}'.encode(), [("event_id", event_id.encode())])
               for n, event_id in enumerate(ids)]
    return ids, records


def _faults(dsn: str, sequence: str = "read_only_faults") -> int:
    """How many of the handler's rows met the trigger's fault (its sequence's last value)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT last_value, is_called FROM {}").format(sql.Identifier(sequence))).fetchone()
    assert row is not None
    return int(row[0]) if row[1] else 0


def _handlers(mode: str, before: Any, *, swallow: bool = False) -> dict[str, Any]:
    """The consumer's handler arguments for ``mode``; ``before(conn)`` runs before the writes
    (the statements handler has no connection: its faults come from the trigger only).  With
    ``swallow`` the handler catches the database errors of its writes and returns (a handler's
    bug: its transaction is aborted all the same)."""
    if mode == "statements":
        return {"statements": lambda m: [(_INSERT, (m.event_id, m.json()["n"]))]}
    if mode == "batch_handler":
        def apply(conn: psycopg.Connection[Any], messages: Any) -> None:
            before(conn)
            with conn.cursor() as cur, _swallowing(swallow):
                cur.executemany(_INSERT, [(m.event_id, m.json()["n"]) for m in messages])
        return {"batch_handler": apply}

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        before(conn)
        with _swallowing(swallow):
            record_effect(conn, message)
    return {"handler": handler}


@contextmanager
def _swallowing(swallow: bool) -> Iterator[None]:
    try:
        yield
    except psycopg.Error:
        if not swallow:
            raise


def _run(sdk_db: str, broker: Any, sdk_topic: str, run_consumer: Any, *, mode: str,
         before: Any = lambda conn: None, swallow: bool = False,
         **overrides: Any) -> tuple[Any, Any, list[str], list[dict[str, Any]]]:
    ids, records = _events(10)
    produce_raw(broker.bootstrap, sdk_topic, records)
    batch_size = 16 if mode in ("batched", "batch_handler") else 1
    config = make_config(sdk_db, broker, sdk_topic, batch_size=batch_size, check_retention=False, retry=RETRY,
                         db_backoff_initial_s=0.05, db_backoff_max_s=0.2, **overrides)
    with capture_logs() as logs:
        handlers = _handlers(mode, before, swallow=swallow)
        thread = run_consumer(config, handlers.pop("handler", None), **handlers)
        wait_settled(thread, len(ids))
        thread.stop()
    return thread, config, ids, logs


def _assert_waited_not_judged(thread: Any, config: Any, sdk_db: str, sdk_topic: str, ids: list[str],
                              logs: list[dict[str, Any]], error_type: str = "DatabaseUnavailable",
                              ) -> list[dict[str, Any]]:
    """Every effect once, nothing dead-lettered, no handler attempt counted; the batch
    retried as for the database (returns those ``batch_retrying`` lines)."""
    labels = {"consumer": config.name, "topic": sdk_topic}
    assert [e for e in logs if e["event"] in ("handler_failed", "message_dead_lettered")] == []
    assert thread.sample("outbox_consumer_handler_errors_total", **labels) == 0
    assert thread.consumer.totals.dead_lettered == 0
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) and set(effects.values()) == {1}
    retried = [e for e in logs if e["event"] == "batch_retrying"]
    assert retried and {e["error_type"] for e in retried} == {error_type}
    assert thread.sample("outbox_consumer_database_errors_total", consumer=config.name) >= 1
    return retried


@pytest.mark.parametrize("mode", ["single", "batched", "batch_handler", "statements"])
def test_a_handler_meeting_a_read_only_database_is_waited_for_not_dead_lettered(
        sdk_db, broker, sdk_topic, run_consumer, mode):
    _fault_first_rows(sdk_db, "read_only_faults", errcode="read_only_sql_transaction",
                      message="cannot execute INSERT in a read-only transaction")
    thread, config, ids, logs = _run(sdk_db, broker, sdk_topic, run_consumer, mode=mode)
    retried = _assert_waited_not_judged(thread, config, sdk_db, sdk_topic, ids, logs)
    assert any(e["error"].startswith("the database is read-only (a standby, or a failover in progress)")
               for e in retried)
    assert _faults(sdk_db) > FAULTS  # every fault was met, then the rows went through


@pytest.mark.parametrize("mode", ["single", "batched", "batch_handler"])
def test_a_handler_whose_session_is_terminated_is_retried_not_judged(
        sdk_db, broker, sdk_topic, run_consumer, mode):
    terminated: list[int] = []

    def terminate_own_session(conn: psycopg.Connection[Any]) -> None:
        """The first FAULTS calls end the handler's session mid-handler (57P01), as a DBA or a
        failover does; the handler's next statement meets it."""
        if len(terminated) >= FAULTS:
            return
        pid = conn.info.backend_pid
        with psycopg.connect(sdk_db, autocommit=True) as admin:
            row = admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone()
        assert row is not None and row[0], f"backend {pid} was not terminated"
        terminated.append(pid)

    thread, config, ids, logs = _run(sdk_db, broker, sdk_topic, run_consumer, mode=mode,
                                     before=terminate_own_session)
    _assert_waited_not_judged(thread, config, sdk_db, sdk_topic, ids, logs)
    assert len(terminated) == FAULTS


@pytest.mark.parametrize("mode", ["single", "batched", "batch_handler", "statements"])
def test_a_handler_whose_transaction_meets_a_serialization_failure_is_retried_not_judged(
        sdk_db, broker, sdk_topic, run_consumer, mode):
    """40001 raised by the server under the handler's INSERT (a trigger, the first FAULTS rows):
    the transaction is run again, no attempt counted, nothing dead-lettered."""
    _fault_first_rows(sdk_db, "conflict_faults", errcode="serialization_failure",
                      message="could not serialize access due to concurrent update")
    thread, config, ids, logs = _run(sdk_db, broker, sdk_topic, run_consumer, mode=mode)
    retried = _assert_waited_not_judged(thread, config, sdk_db, sdk_topic, ids, logs,
                                        error_type="TransactionConflict")
    assert all(e["error"].startswith("transaction aborted: could not serialize access") for e in retried)
    assert _faults(sdk_db, "conflict_faults") > FAULTS


@pytest.mark.parametrize("swallow", [False, True])
def test_a_handler_chosen_as_a_deadlocks_victim_is_retried_not_judged(sdk_db, broker, sdk_topic, run_consumer,
                                                                       swallow):
    """A real deadlock (40P01): the handler's first call locks row 1, then waits for row 2,
    which another session holds and which then waits for row 1.  The handler waited first,
    so its deadlock check runs first and the server aborts its transaction; the other
    session then commits.  The handler's message is applied once on the next try.  With
    ``swallow`` the handler catches the deadlock and goes on: its next statement meets the
    aborted transaction (25P02), which is judged by the deadlock it caught (before, that
    was the handler's failure: an attempt counted, dead-lettered after the policy's)."""
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL DEFAULT 0)")
        conn.execute("INSERT INTO hot (id) VALUES (1), (2)")
    other_holds_2, other_done = threading.Event(), threading.Event()

    def other_session(handler_pid: int) -> None:
        with psycopg.connect(sdk_db) as other:
            # PostgreSQL's victim is the session whose deadlock check runs first, each after its
            # own deadlock_timeout (1 s) of waiting: the handler, which waits first, unless a
            # loaded machine runs its check late (CI once: the other session was the victim,
            # the handler went on, nothing was retried).  This one checks after a minute.
            other.execute("SET deadlock_timeout = '60s'")
            other.execute("UPDATE hot SET n = n + 1 WHERE id = 2")
            other_holds_2.set()
            with psycopg.connect(sdk_db, autocommit=True) as watch:  # the handler waits on row 2 first
                wait_for(lambda: watch.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity "
                                               "WHERE pid = %s", (handler_pid,)).fetchone() == (True,),
                         timeout_s=10, message="the handler never waited for row 2")
            other.execute("UPDATE hot SET n = n + 1 WHERE id = 1")  # waits for the handler: a cycle
            other.commit()
        other_done.set()

    def deadlocking(conn: psycopg.Connection[Any]) -> None:
        conn.execute("UPDATE hot SET n = n + 1 WHERE id = 1")
        if not other_holds_2.is_set():
            threading.Thread(target=other_session, args=(conn.info.backend_pid,), daemon=True).start()
            assert other_holds_2.wait(10), "the other session never locked row 2"
        with _swallowing(swallow):
            conn.execute("UPDATE hot SET n = n + 1 WHERE id = 2")

    thread, config, ids, logs = _run(sdk_db, broker, sdk_topic, run_consumer, mode="single", before=deadlocking)
    retried = _assert_waited_not_judged(thread, config, sdk_db, sdk_topic, ids, logs,
                                        error_type="TransactionConflict")
    assert any(e["error"].startswith("transaction aborted: deadlock detected") for e in retried)
    assert other_done.wait(10), "the other session never committed"
    with psycopg.connect(sdk_db, autocommit=True) as conn:  # every handler call once, the other session once
        assert conn.execute("SELECT n FROM hot ORDER BY id").fetchall() == [(len(ids) + 1,), (len(ids) + 1,)]


@pytest.mark.parametrize(("errcode", "mode"), [
    ("serialization_failure", "single"), ("serialization_failure", "batched"),
    ("serialization_failure", "batch_handler"), ("read_only_sql_transaction", "single"),
    ("read_only_sql_transaction", "batch_handler")])
def test_a_handler_that_catches_the_databases_error_and_returns_is_retried_not_judged(
        sdk_db, broker, sdk_topic, run_consumer, errcode, mode):
    """The handler catches the 40001 or 25006 its write met (the trigger, the first FAULTS
    rows) and returns: its transaction is aborted all the same, by the database's doing.
    Retried as when it does not catch (TransactionConflict; the read-only wait), no attempt
    counted, nothing dead-lettered.  Before, HandlerTransactionFailed: an attempt of the
    retry policy, and the records dead-lettered after its two."""
    _fault_first_rows(sdk_db, "caught_faults", errcode=errcode, message=f"{errcode} under the handler")
    thread, config, ids, logs = _run(sdk_db, broker, sdk_topic, run_consumer, mode=mode, swallow=True)
    conflict = errcode == "serialization_failure"
    retried = _assert_waited_not_judged(thread, config, sdk_db, sdk_topic, ids, logs,
                                        error_type="TransactionConflict" if conflict else "DatabaseUnavailable")
    assert any(e["error"].startswith("transaction aborted: serialization_failure under the handler" if conflict
                                     else "the database is read-only (a standby, or a failover in progress)")
               for e in retried)
    assert _faults(sdk_db, "caught_faults") > FAULTS


def test_a_handler_that_catches_its_own_error_is_still_judged_and_told_what_it_caught(
        sdk_db, broker, sdk_topic, run_consumer):
    """A handler that swallows its own failing statement (a constraint) and returns: the
    retry policy's, as before, and the error now names what it caught."""
    ids, records = _events(3)
    poisoned = ids[1]

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        with _swallowing(True):
            if str(message.event_id) == poisoned:
                conn.execute("INSERT INTO effects (event_id, consumer) VALUES (NULL, 'c')")
            record_effect(conn, message)

    produce_raw(broker.bootstrap, sdk_topic, records)
    config = make_config(sdk_db, broker, sdk_topic, check_retention=False, retry=RETRY)
    with capture_logs() as logs:
        thread = run_consumer(config, handler)
        wait_settled(thread, len(ids))
        wait_for(lambda: thread.consumer.totals.dead_lettered == 1, timeout_s=30,
                 message="the failing record was not dead-lettered")
        thread.stop()
    [letter] = [e for e in logs if e["event"] == "message_dead_lettered"]
    assert letter["reason"] == "retries_exhausted" and letter["attempts"] == RETRY.max_attempts
    failed = [e for e in logs if e["event"] == "handler_failed"]
    assert len(failed) == RETRY.max_attempts and all(
        "HandlerTransactionFailed" in e["error"] and "It caught NotNullViolation: null value in column" in e["error"]
        for e in failed), failed
    assert set(effect_counts(sdk_db)) == set(ids) - {poisoned}


@pytest.mark.parametrize("mode", ["single", "batched"])
@pytest.mark.parametrize("fault", ["not_null_violation", "query_canceled"])
def test_a_handlers_own_database_error_is_still_judged_by_the_policy(
        sdk_db, broker, sdk_topic, run_consumer, mode, fault):
    """A constraint the handler violates (23502), its statement cancelled by its own
    statement_timeout (57014, an OperationalError): the handler's failures, as before."""
    ids, records = _events(3)
    poisoned = ids[1]

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        if str(message.event_id) == poisoned:
            if fault == "not_null_violation":
                conn.execute("INSERT INTO effects (event_id, consumer) VALUES (NULL, 'c')")
            else:
                conn.execute("SET LOCAL statement_timeout = '1ms'")
                conn.execute("SELECT pg_sleep(1)")
        record_effect(conn, message)

    produce_raw(broker.bootstrap, sdk_topic, records)
    config = make_config(sdk_db, broker, sdk_topic, batch_size=16 if mode == "batched" else 1,
                         check_retention=False, retry=RETRY)
    with capture_logs() as logs:
        thread = run_consumer(config, handler)
        wait_settled(thread, len(ids))
        wait_for(lambda: thread.consumer.totals.dead_lettered == 1, timeout_s=30,
                 message="the failing record was not dead-lettered")
        thread.stop()
    labels = {"consumer": config.name, "topic": sdk_topic}
    assert thread.sample("outbox_consumer_handler_errors_total", **labels) == RETRY.max_attempts
    [letter] = [e for e in logs if e["event"] == "message_dead_lettered"]
    assert letter["reason"] == "retries_exhausted" and letter["attempts"] == RETRY.max_attempts
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) - {poisoned} and set(effects.values()) == {1}
