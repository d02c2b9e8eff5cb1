"""A mark statement the server cancelled (a ``statement_timeout`` shorter than the mark:
relay/marker.py MarkCancelled, relay/app_deps.py), on the real PostgreSQL and broker.

The server answers, the statement was too slow for the timeout: before, the cancel took the
outage's path (``database_unavailable``, ``database_up`` 0, the claims and LISTEN
connections dropped).  Now it is ``mark_statement_cancelled``, naming the setting to raise,
and the rows of the cancelled mark are claimed again: every event reaches the broker."""

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


def test_a_mark_the_statement_timeout_cancelled_is_said_as_that_not_as_an_outage(outbox_db, broker, topic):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(SLOW_MARKS)
    insert_rows(outbox_db, topic, 100, keys=10)
    log = Log()
    relay = RelayThread(make_conninfo(outbox_db, options="-c statement_timeout=300"), broker.bootstrap,
                        owner="cancelled")
    relay.relay.log = log
    with relay:
        wait_until(lambda: any(event == "mark_statement_cancelled" for event, _ in log.events), timeout_s=20,
                   message=lambda: f"not said: {[event for event, _ in log.events]}")
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("DELETE FROM slow_marks")  # the marks fit in the timeout again
        wait_drained(outbox_db, timeout_s=60)
        assert relay.metrics.registry.get_sample_value("outbox_relay_database_up") == 1
    said = [fields for event, fields in log.events if event == "mark_statement_cancelled"]
    assert said[0]["connection"] == "outbox-relay:cancelled:mark", said
    assert "statement timeout" in str(said[0]["error"]) and "statement_timeout" in str(said[0]["detail"]), said
    assert not [event for event, _ in log.events if event == "database_unavailable"], log.events
    expected = all_event_ids(outbox_db)
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert delivery.missing == set() and delivery.order_violations == [], delivery
