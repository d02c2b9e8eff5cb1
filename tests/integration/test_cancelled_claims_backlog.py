"""A lock on the outbox held longer than the relay's ``statement_timeout`` while a backlog
drains, on the real PostgreSQL and broker (relay/app_run.py, relay/app_deps.py
``_statement_cancelled``, relay/mark_cancels.py).

A migration's ``ALTER TABLE`` holds such a lock: the relay's claims and marks are cancelled
(57014) meanwhile, with batches produced and awaiting their marks.  A cancelled claim asks
a rewind (back to "nothing seen"); the rewind waits until no row is in flight (relay/pump.py
``_active``), so the rows of those batches are marked, not claimed and published again.
Every event reaches the topic once, in order, once the lock is gone."""

from __future__ import annotations

import psycopg
from psycopg.conninfo import make_conninfo

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    pending,
    wait_drained,
)
from tests.fixtures.procs import wait_until
from tests.unit.test_heartbeat_late import Log

ROWS = 20_000
#: Locks taken, one after the other, until one cancelled a claim and a mark: one that comes
#: after the mark statement in progress merged every batch in flight cancels claims only, and
#: one that comes while the pipeline is full of batches waiting for their marks cancels marks
#: only (the pump claims nothing then: under CI's load, every lock of a run in ten seconds).
LOCKS = 8
#: How long a lock waits for a claim and a mark to be cancelled before it is let go.
LOCK_S = 5.0

#: Marks a little slow (100 ms a statement), so that batches wait for their marks: the
#: backlog is claimed and produced ahead of them, as a busy database's marks lag.
SLOW_MARKS = """
CREATE FUNCTION slow_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.1); RETURN NULL; END $$;
CREATE TRIGGER slow_mark BEFORE UPDATE OF published_at ON outbox FOR EACH STATEMENT
  WHEN (current_setting('application_name') LIKE '%:mark%') EXECUTE FUNCTION slow_mark();
"""


def _cancelled(relay: RelayThread, name: str, labels: dict[str, str]) -> float:
    return relay.metrics.registry.get_sample_value(name, labels) or 0.0


def _marks_waiting(relay: RelayThread) -> int:
    pump = relay.relay.pump
    return 0 if pump is None else sum(not mark.future.done() for mark in list(pump.marking))


def _locked_while_marking(outbox_db: str, relay: RelayThread, claims: tuple[str, dict[str, str]],
                          marks: tuple[str, dict[str, str]]) -> tuple[bool, bool]:
    """Hold the outbox's lock until a claim and a mark are cancelled, or :data:`LOCK_S`.
    Whether a claim, and a mark, were cancelled under it."""
    claims_before, marks_before = _cancelled(relay, *claims), _cancelled(relay, *marks)
    with psycopg.connect(outbox_db) as locker:  # a transaction holds the outbox's lock
        locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        try:
            wait_until(lambda: _cancelled(relay, *claims) > claims_before and _cancelled(relay, *marks) > marks_before,
                       timeout_s=LOCK_S)
        except AssertionError:
            pass  # not both under this lock: the caller takes another
        return _cancelled(relay, *claims) > claims_before, _cancelled(relay, *marks) > marks_before


def test_a_lock_on_the_outbox_while_a_backlog_drains_publishes_nothing_twice(outbox_db, broker, topic):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(SLOW_MARKS)
    insert_rows(outbox_db, topic, ROWS, keys=20, per_tx=1000)
    log = Log()
    relay = RelayThread(make_conninfo(outbox_db, options="-c statement_timeout=300"), broker.bootstrap,
                        owner="locked", batch_size=100, pipeline_depth=64, mark_connections=1)
    relay.relay.log = log
    claims = ("outbox_relay_statements_cancelled_total", {"statement": "claim"})
    marks = ("outbox_relay_mark_statements_cancelled_total", {"connection": "outbox-relay:locked:mark"})
    seen: list[tuple[bool, bool]] = []  # (a claim, a mark) cancelled, under each lock
    with relay:
        for _ in range(LOCKS):
            wait_until(lambda: _marks_waiting(relay) >= 2, timeout_s=20,
                       message=lambda: f"no marks waiting: {pending(outbox_db)} pending")
            seen.append(_locked_while_marking(outbox_db, relay, claims, marks))
            if seen[-1] == (True, True):
                break
        wait_drained(outbox_db, timeout_s=30)
    # The case this test is for: a claim cancelled while batches waited for their marks (a
    # mark cancelled under the same lock), whose rewind must not send those batches again.
    assert (True, True) in seen, f"no lock cancelled both a claim and a mark: {seen}"
    events = [event for event, _ in log.events]
    assert "statement_recovered" in events and "database_unavailable" not in events, events
    expected = all_event_ids(outbox_db)
    records = read_all(broker.bootstrap, topic, expected=expected, timeout_s=30, extra_wait_s=1.0)
    delivery = check_delivery(records, expected)
    assert delivery.missing == set() and delivery.order_violations == [], delivery
    assert delivery.duplicates == 0, f"{delivery.duplicates} events published again"
