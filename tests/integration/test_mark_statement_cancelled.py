"""A mark statement the server cancelled (a ``statement_timeout`` shorter than the mark:
relay/marker.py MarkCancelled, relay/mark_cancels.py, relay/app_deps.py), on the real
PostgreSQL and broker.

The server answers, the statement was too slow for the timeout, and nothing of it
committed.  Before 50b1f66 the cancel took the outage's path (``database_unavailable``,
``database_up`` 0); then it was said ``mark_statement_cancelled`` and the loop rewound: the
rows of the marks in flight were claimed and published again, at each cancel while it
lasted.  Now the mark thread marks the same rows again after a back-off (in halves when
cancelled again): every event reaches the broker exactly once, and every row is marked."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from relay.probes import health
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

#: Marks made slower than the relay's statement_timeout while ``slow_marks`` has a row.
SLOW_MARKS = """
CREATE TABLE slow_marks (since timestamptz DEFAULT now());
INSERT INTO slow_marks DEFAULT VALUES;
CREATE FUNCTION slow_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT FROM slow_marks) THEN PERFORM pg_sleep(2); END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER slow_mark BEFORE UPDATE OF published_at ON outbox FOR EACH STATEMENT
  WHEN (current_setting('application_name') LIKE '%:mark%') EXECUTE FUNCTION slow_mark();
"""

#: Marks of more than 150 rows made slower than the relay's statement_timeout: a timeout
#: merely shorter than a big mark.
SLOW_BIG_MARKS = """
CREATE FUNCTION slow_big_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF (SELECT count(*) FROM marked) > 150 THEN PERFORM pg_sleep(2); END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER slow_big_mark AFTER UPDATE ON outbox REFERENCING NEW TABLE AS marked
  FOR EACH STATEMENT WHEN (current_setting('application_name') LIKE '%:mark%')
  EXECUTE FUNCTION slow_big_mark();
"""


def _relay(outbox_db: str, broker: Any, owner: str, log: Log, **overrides: Any) -> RelayThread:
    relay = RelayThread(make_conninfo(outbox_db, options="-c statement_timeout=300"), broker.bootstrap,
                        owner=owner, **overrides)
    relay.relay.log = log
    return relay


def _delivered_once(outbox_db: str, broker: Any, topic: str) -> None:
    expected = all_event_ids(outbox_db)
    records = read_all(broker.bootstrap, topic, expected=expected, timeout_s=60, extra_wait_s=1.0)
    delivery = check_delivery(records, expected)
    assert delivery.missing == set() and delivery.order_violations == [], delivery
    assert delivery.duplicates == 0, f"{delivery.duplicates} events published again"


def test_a_mark_the_statement_timeout_cancels_is_marked_again_not_published_again(outbox_db, broker, topic):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(SLOW_MARKS)
    insert_rows(outbox_db, topic, 100, keys=10)
    log = Log()
    relay = _relay(outbox_db, broker, "cancelled", log)
    with relay:
        wait_until(lambda: (relay.metrics.registry.get_sample_value(
                       "outbox_relay_mark_statements_cancelled_total",
                       {"connection": "outbox-relay:cancelled:mark"}) or 0) >= 2, timeout_s=20,
                   message=lambda: f"not cancelled twice: {[event for event, _ in log.events]}")
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("DELETE FROM slow_marks")  # the marks fit in the timeout again
        wait_drained(outbox_db, timeout_s=30)
        assert relay.metrics.registry.get_sample_value("outbox_relay_database_up") == 1
    events = [event for event, _ in log.events]
    said = [fields for event, fields in log.events if event == "mark_statement_cancelled"]
    assert len(said) == 1 and said[0]["connection"] == "outbox-relay:cancelled:mark", said  # once a streak
    assert "statement timeout" in str(said[0]["error"]) and "statement_timeout" in str(said[0]["detail"]), said
    assert "mark_statement_recovered" in events and "database_unavailable" not in events, events
    _delivered_once(outbox_db, broker, topic)


def test_marks_longer_than_the_statement_timeout_get_through_in_parts(outbox_db, broker, topic):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(SLOW_BIG_MARKS)
    insert_rows(outbox_db, topic, 800, keys=10)
    log = Log()
    with _relay(outbox_db, broker, "parts", log, mark_connections=1, batch_size=400):
        wait_drained(outbox_db, timeout_s=30)
    recovered = [fields for event, fields in log.events if event == "mark_statement_recovered"]
    assert recovered and all(int(fields["rows_per_statement"]) <= 150 for fields in recovered), recovered
    assert "database_unavailable" not in [event for event, _ in log.events]
    _delivered_once(outbox_db, broker, topic)


def test_a_relay_whose_marks_the_server_cancels_is_not_called_stuck(outbox_db, broker, topic):
    """Liveness is for what a restart fixes (relay/probes.py): a relay marking again the rows
    whose marks the server cancels (a lock on them, a timeout) is not wedged, and a restart
    would publish again every row in flight.  Between its tries (the back-off) no statement
    of it is on the server, so the wait watch finds nothing: the streak itself must say so."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(SLOW_MARKS)
    insert_rows(outbox_db, topic, 100, keys=10)
    log = Log()
    relay = _relay(outbox_db, broker, "alive", log, stuck_after_s=0.5)
    with relay:
        wait_until(lambda: (relay.metrics.registry.get_sample_value(
                       "outbox_relay_mark_statements_cancelled_total",
                       {"connection": "outbox-relay:alive:mark"}) or 0) >= 2, timeout_s=20,
                   message=lambda: f"not cancelled twice: {[event for event, _ in log.events]}")
        ok, body = health(relay.relay, loop_connection="outbox-relay:alive")
        assert body["seconds_since_publish"] > 0.5 and body["pending"] > 0, body
        assert ok, f"a relay whose marks the server cancels was called stuck: {body}"
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("DELETE FROM slow_marks")
        wait_drained(outbox_db, timeout_s=30)
    _delivered_once(outbox_db, broker, topic)
