"""Issue 15, item 4: a failover to a read-only node is waited for like an outage.

`default_transaction_read_only` turned on and every backend terminated is what a
relay sees when its DSN now points at a standby (or a primary demoted for
maintenance): connections succeed, reads work, every write fails with
SQLSTATE 25006.  The relay must keep running, say so in one event, and relay
everything once the database is writable again."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    all_event_ids,
    check_delivery,
    insert_rows,
    migrated,
    pending,
    relay_cmd,
    relay_env,
    wait_drained,
)


def _set_read_only(admin_dsn: str, dbname: str, on: bool) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        if on:
            conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
        conn.execute("SELECT pg_reload_conf()")
        if on:  # sessions keep the setting they started with: end them, as a failover does
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))


@pytest.fixture
def read_only_switch(own_pg_running) -> Iterator[object]:
    admin = own_pg_running.admin_dsn
    yield admin
    _set_read_only(admin, "postgres", False)  # never leave the shared server read-only


def test_relay_waits_for_a_read_only_database_and_loses_nothing(own_db_dsn, read_only_switch,
                                                                broker, topic, spawn):
    dsn = migrated(own_db_dsn)
    dbname = conninfo_to_dict(dsn)["dbname"]
    admin = str(read_only_switch)
    insert_rows(dsn, topic, 500, keys=20)
    relay = spawn(relay_cmd("run"), env=relay_env(dsn, broker.bootstrap, backoff_max_s=1),
                  name="relay")
    wait_drained(dsn, timeout_s=60)

    since = relay.log_size()
    _set_read_only(admin, dbname, True)
    # Rows the relay has yet to publish, committed by a session that may still write.
    writer = make_conninfo(dsn, options="-c default_transaction_read_only=off")
    insert_rows(writer, topic, 500, keys=20, start=500)
    relay.wait_for_log("database_read_only", timeout_s=30, since=since)
    # Still running some seconds later: it waits instead of exiting.
    with pytest.raises(TimeoutError):
        relay.wait(timeout=6)
    assert pending(dsn) > 0  # nothing could be marked meanwhile

    _set_read_only(admin, dbname, False)
    wait_drained(dsn, timeout_s=120)
    relay.wait_for_log("database_recovered", timeout_s=30, since=since)
    assert relay.alive
    relay.sigterm()
    assert relay.wait(30) == 0
    log = relay.log_text()
    assert "Traceback" not in log, relay.log_tail()
    expected = all_event_ids(dsn)
    assert len(expected) == 1000
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60),
                              expected)
    assert delivery.missing == set() and delivery.order_violations == []
