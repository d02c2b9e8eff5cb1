"""A failover to a read-only node, seen by the dedup consumer (real PostgreSQL, real broker).

What a consumer meets when its DSN now leads to a standby, or to a primary demoted for
maintenance: connections succeed, reads work, every write fails with SQLSTATE 25006.
Here that is ``default_transaction_read_only`` set on the test's database and its sessions
ended.  The consumer must wait as for an unreachable database (its partitions paused, the
group kept), say why, and apply everything once when the database is writable again; it
stopped with a FatalError ("inbox statement failed: cannot execute INSERT in a read-only
transaction") before, as the relay did until issue 15.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from structlog.testing import capture_logs

from tests.integration.sdk._support import (
    effect_counts,
    make_config,
    produce_raw,
    record_effect,
    wait_for,
    wait_settled,
)


def _set_read_only(dsn: str, on: bool) -> None:
    """The database's new sessions read-only (or not); its sessions ended, as a failover does."""
    dbname = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(dsn, autocommit=True, options="-c default_transaction_read_only=off") as conn:
        setting = "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
        conn.execute(sql.SQL("ALTER DATABASE {} " + setting).format(sql.Identifier(dbname)))
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                     "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))


def _events(count: int, start: int) -> tuple[list[str], list[tuple[bytes, bytes, list[tuple[str, bytes]]]]]:
    """``count`` events numbered from ``start``: their ids, and the records to produce."""
    ids = [str(uuid.uuid4()) for _ in range(count)]
    records = [(b"k", f'{{"n": {start + n}}}'.encode(), [("event_id", event_id.encode())])
               for n, event_id in enumerate(ids)]
    return ids, records


@pytest.mark.parametrize("batch_size", [1, 16], ids=["single", "batched"])
def test_the_consumer_waits_for_a_read_only_database_and_applies_everything_once(
        sdk_db, broker, sdk_topic, run_consumer, batch_size):
    first_ids, first = _events(20, 0)
    produce_raw(broker.bootstrap, sdk_topic, first)
    config = make_config(sdk_db, broker, sdk_topic, batch_size=batch_size, check_retention=False,
                         db_backoff_initial_s=0.05, db_backoff_max_s=0.2)
    applied: list[int] = []

    def handler(conn: psycopg.Connection[Any], message: Any) -> None:
        record_effect(conn, message)
        applied.append(message.json()["n"])

    try:
        with capture_logs() as logs:
            thread = run_consumer(config, handler)
            wait_settled(thread, len(first))
            _set_read_only(sdk_db, True)
            second_ids, second = _events(20, len(first))
            produce_raw(broker.bootstrap, sdk_topic, second)
            errors = "outbox_consumer_database_errors_total"
            wait_for(lambda: thread.sample(errors, consumer=config.name) >= 3 or thread.error is not None,
                     timeout_s=30, message="the consumer never met the read-only database")
            assert thread.error is None, f"the consumer stopped: {thread.error!r}"
            assert thread.consumer.totals.settled == len(first)  # nothing settled while read-only
            _set_read_only(sdk_db, False)
            wait_settled(thread, len(first) + len(second))
            thread.stop()
    finally:
        _set_read_only(sdk_db, False)
    effects = effect_counts(sdk_db)
    assert set(effects) == set(first_ids + second_ids) and set(effects.values()) == {1}
    # The sessions ended first (a lost connection), then every new one was read-only.
    read_only = [e for e in logs if e["event"] == "batch_retrying"
                 and e["error"].startswith("the database is read-only (a standby, or a failover in progress)")]
    assert read_only and {e["error_type"] for e in read_only} == {"DatabaseUnavailable"}


def test_a_consumer_started_on_a_read_only_database_waits_for_a_writable_one(
        sdk_db, broker, sdk_topic, run_consumer):
    ids, records = _events(10, 0)
    produce_raw(broker.bootstrap, sdk_topic, records)
    config = make_config(sdk_db, broker, sdk_topic, check_retention=False,
                         db_backoff_initial_s=0.05, db_backoff_max_s=0.2)
    try:
        _set_read_only(sdk_db, True)
        with capture_logs() as logs:
            thread = run_consumer(config, record_effect)
            wait_for(lambda: any(e["event"] == "database_unavailable" for e in logs) or thread.error is not None,
                     timeout_s=30, message="the consumer never said it waits for the database")
            assert thread.error is None, f"the consumer stopped: {thread.error!r}"
            _set_read_only(sdk_db, False)
            wait_settled(thread, len(ids))
            thread.stop()
    finally:
        _set_read_only(sdk_db, False)
    waiting = next(e for e in logs if e["event"] == "database_unavailable")
    assert waiting["error"].startswith("the database is read-only (a standby, or a failover in progress)")
    effects = effect_counts(sdk_db)
    assert set(effects) == set(ids) and set(effects.values()) == {1}
