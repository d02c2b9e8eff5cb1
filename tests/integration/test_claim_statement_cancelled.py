"""A claim the server cancelled (57014: a ``statement_timeout`` shorter than the claim;
here a lock on the outbox held longer than it, as a migration's ALTER TABLE holds one),
on the real PostgreSQL and broker (relay/app_deps.py ``_statement_cancelled``).

The database answers, the statement was too slow for the timeout.  Before, a cancelled
claim took the outage's path: ``database_unavailable``, ``database_up`` 0, every connection
dropped, at each claim while it lasted.  Now it is ``statement_cancelled`` once (naming the
setting), tried again after a back-off, and ``statement_recovered`` once a turn passes."""

from __future__ import annotations

import psycopg
from psycopg.conninfo import make_conninfo

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    wait_drained,
)
from tests.fixtures.procs import wait_until
from tests.unit.test_heartbeat_late import Log


def test_a_claim_the_statement_timeout_cancels_is_a_slow_statement_not_an_outage(outbox_db, broker, topic):
    insert_rows(outbox_db, topic, 20, keys=5)
    log = Log()
    relay = RelayThread(make_conninfo(outbox_db, options="-c statement_timeout=300"), broker.bootstrap,
                        owner="slowclaim")
    relay.relay.log = log
    with relay:
        wait_drained(outbox_db, timeout_s=20)
        claims_pid = _backend(outbox_db, "outbox-relay:slowclaim")
        with psycopg.connect(outbox_db) as locker:  # a transaction holds the outbox's lock
            locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
            wait_until(lambda: {"statement_cancelled", "database_unavailable"} & {event for event, _ in log.events},
                       timeout_s=20, message=lambda: f"not said: {[event for event, _ in log.events]}")
            assert "database_unavailable" not in [event for event, _ in log.events], log.events
            wait_until(lambda: relay.relay._cancels.failures >= 2, timeout_s=20,
                       message=lambda: f"claims not cancelled twice: {[event for event, _ in log.events]}")
            assert relay.metrics.registry.get_sample_value("outbox_relay_database_up") == 1
            # The claims connection answered the cancel: kept, not dropped and opened again.
            assert _backend(outbox_db, "outbox-relay:slowclaim") == claims_pid
            assert relay.metrics.registry.get_sample_value("outbox_relay_statements_cancelled_total",
                                                           {"statement": "claim"}) >= 1
        insert_rows(outbox_db, topic, 20, keys=5, start=20)
        wait_drained(outbox_db, timeout_s=20)
        wait_until(lambda: any(event == "statement_recovered" for event, _ in log.events), timeout_s=10,
                   message=lambda: f"not recovered: {[event for event, _ in log.events]}")
    events = [event for event, _ in log.events]
    said = [fields for event, fields in log.events if event == "statement_cancelled"]
    assert len(said) == 1 and said[0]["connection"] == "outbox-relay:slowclaim", said  # once a streak
    assert "statement timeout" in str(said[0]["error"]) and "statement_timeout" in str(said[0]["detail"]), said
    assert "database_unavailable" not in events, events
    expected = all_event_ids(outbox_db)
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=30), expected)
    assert delivery.missing == set(), delivery


def _backend(dsn: str, application_name: str) -> int | None:
    """The pid of the session named ``application_name`` (None: there is none)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                           (application_name,)).fetchone()
    return None if row is None else int(row[0])
