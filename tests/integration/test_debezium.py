"""Drop-in interop (issue 6): an existing Debezium outbox-router table relayed end to end
with its routing, its writers unchanged."""

from __future__ import annotations

import json
import re
import subprocess
import uuid

import psycopg
from psycopg import sql

from outbox_embedded.queries import query
from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import RelayThread, relay_cmd, scalar
from tests.fixtures.procs import wait_until


def debezium_table(schema: str = "app", name: str = "outbox_events") -> sql.Composed:
    """The CREATE TABLE of a Debezium outbox table (Debezium's own columns) named schema.name."""
    return sql.SQL(query("bench", "debezium_table")).format(table=sql.Identifier(schema, name))


DEBEZIUM_TABLE = debezium_table()

def write(conn: psycopg.Connection, aggregate: str, aggregate_id: str, kind: str, seq: int) -> str:
    """Exactly what a service writing for Debezium's outbox router does."""
    event_id = str(uuid.uuid4())
    conn.execute("INSERT INTO app.outbox_events (id, aggregatetype, aggregateid, type, payload) "
                 "VALUES (%s, %s, %s, %s, %s)",
                 (event_id, aggregate, aggregate_id, kind, json.dumps({"seq": seq, "key": aggregate_id})))
    return event_id


def test_debezium_layout_is_relayed_with_its_routing(outbox_db, broker, topic_name):
    suffix = uuid.uuid4().hex[:6]
    order_type, customer_type = f"Order{suffix}", f"Customer{suffix}"
    for aggregate in (order_type, customer_type):
        create_topic(broker.bootstrap, f"outbox.event.{aggregate}", partitions=3)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(DEBEZIUM_TABLE)
        early = write(conn, order_type, "o-1", "OrderCreated", 0)  # written before adoption
    adopted = subprocess.run(relay_cmd("migrate", "--dsn", outbox_db, "--debezium-table",
                                       "app.outbox_events", "--cloudevents-source", "/orders-service",
                                       "--existing", "pending"),
                             capture_output=True, text=True)
    assert adopted.returncode == 0, adopted.stderr
    assert "--table app.outbox_events_relay" in adopted.stdout

    ids = {early: (order_type, "o-1")}
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        for seq in range(1, 301):
            aggregate = order_type if seq % 3 else customer_type
            key = f"{'o' if seq % 3 else 'c'}-{seq % 7}"
            ids[write(conn, aggregate, key, "Changed", seq)] = (aggregate, key)
    with RelayThread(outbox_db, broker.bootstrap, table="app.outbox_events_relay") as relay:
        wait_until(lambda: scalar(outbox_db, "SELECT count(*) FROM app.outbox_events "
                                             "WHERE relay_published_at IS NULL") == 0,
                   timeout_s=60, message="the Debezium table did not drain")
        # The database shows a mark once its transaction commits, on the mark thread; the
        # counter moves when the pump's thread applies the mark's result a moment later.
        wait_until(lambda: relay.metrics.registry.get_sample_value(
            "outbox_relay_events_published_total", {"topic": f"outbox.event.{order_type}"}) == 201,
            timeout_s=10, message="outbox_relay_events_published_total of the Order topic")
    got = {}
    for aggregate in (order_type, customer_type):
        expected = sum(1 for a, _ in ids.values() if a == aggregate)
        for rec in read_all(broker.bootstrap, f"outbox.event.{aggregate}", expected=expected, timeout_s=60):
            got[rec.headers["event_id"].decode()] = rec
    assert set(got) == set(ids)
    rec = got[early]
    assert rec.key == b"o-1"  # key from the aggregate id
    assert json.loads(rec.value) == {"seq": 0, "key": "o-1"}
    assert rec.headers["id"].decode() == early and rec.headers["eventType"] == b"OrderCreated"
    assert rec.headers["ce_id"].decode() == early and rec.headers["ce_type"] == b"OrderCreated"
    assert rec.headers["ce_source"] == b"/orders-service" and rec.headers["ce_specversion"] == b"1.0"
    assert rec.headers["ce_time"].endswith(b"Z")
    # Per-key order holds through the view as well.
    last: dict[str, int] = {}
    for r in sorted(got.values(), key=lambda r: (r.topic, r.partition, r.offset)):
        body = json.loads(r.value)
        assert body["seq"] > last.get(r.topic + body["key"], -1)
        last[r.topic + body["key"]] = body["seq"]
    status = json.loads(subprocess.run(relay_cmd("status", "--json", "--dsn", outbox_db, "--table",
                                                 "app.outbox_events_relay"),
                                       capture_output=True, text=True, check=True).stdout)
    assert status["pending"] == 0


def test_a_hostile_topic_template_is_refused(outbox_db):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(DEBEZIUM_TABLE)
    # "" meant the default in silence; "bad topic {type}" routed rows to "bad topic created"
    for template in ("x.{payload}", "x.{aggregatetype'); DROP TABLE outbox; --}", "x}{", "",
                     "bad topic {type}"):
        result = subprocess.run(relay_cmd("migrate", "--dsn", outbox_db, "--debezium-table",
                                          "app.outbox_events", "--topic-template", template),
                                capture_output=True, text=True)
        assert result.returncode == 2, (template, result.stderr)
        assert "--topic-template" in result.stderr and "Traceback" not in result.stderr
    assert scalar(outbox_db, "SELECT to_regclass('outbox') IS NOT NULL") is True


def _adopt_50k(outbox_db: str, broker, aggregate: str, *extra: str) -> tuple[str, set[str]]:
    """A Debezium table with 50,000 rows (Debezium delivered them), adopted; returns
    migrate's stdout and the existing ids."""
    create_topic(broker.bootstrap, f"outbox.event.{aggregate}", partitions=3)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(DEBEZIUM_TABLE)
        conn.execute("INSERT INTO app.outbox_events (id, aggregatetype, aggregateid, type, payload) "
                     "SELECT gen_random_uuid(), %s, 'k-' || (g %% 50), 'Changed', "
                     "jsonb_build_object('seq', g / 50, 'key', 'k-' || (g %% 50)) "
                     "FROM generate_series(0, 49999) AS g ORDER BY g", (aggregate,))
        conn.execute("ANALYZE app.outbox_events")
        existing = {str(r[0]) for r in conn.execute("SELECT id FROM app.outbox_events")}
        filenode = conn.execute("SELECT pg_relation_filenode('app.outbox_events')").fetchone()
    adopted = subprocess.run(relay_cmd("migrate", "--dsn", outbox_db, "--debezium-table",
                                       "app.outbox_events", *extra), capture_output=True, text=True)
    assert adopted.returncode == 0, adopted.stderr
    assert "Traceback" not in adopted.stderr
    # The lock it took and for how long, and no table rewrite (the same file on disk).
    assert re.search(r"locked app\.outbox_events in ACCESS EXCLUSIVE mode for \d+ ms", adopted.stdout)
    assert "numbered 50000 existing rows" in adopted.stdout, adopted.stdout
    assert scalar(outbox_db, "SELECT pg_relation_filenode('app.outbox_events')") == filenode[0]
    assert scalar(outbox_db, "SELECT count(*) FROM app.outbox_events WHERE relay_seq IS NULL") == 0
    return adopted.stdout, existing


def test_adopting_50000_delivered_rows_publishes_none_of_them(outbox_db, broker):
    aggregate = f"Order{uuid.uuid4().hex[:6]}"
    out, existing = _adopt_50k(outbox_db, broker, aggregate)
    assert "existing rows: marked published" in out
    assert scalar(outbox_db, "SELECT count(*) FROM app.outbox_events_relay "
                             "WHERE published_at IS NULL") == 0
    new = {}
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        for seq in range(1000, 1100):
            new[write(conn, aggregate, f"k-{seq % 50}", "Changed", seq)] = seq
    with RelayThread(outbox_db, broker.bootstrap, table="app.outbox_events_relay"):
        wait_until(lambda: scalar(outbox_db, "SELECT count(*) FROM app.outbox_events "
                                             "WHERE relay_published_at IS NULL") == 0,
                   timeout_s=60, message="the new rows did not flow")
    got = {rec.headers["event_id"].decode()
           for rec in read_all(broker.bootstrap, f"outbox.event.{aggregate}", expected=100, timeout_s=30)}
    assert got == set(new)  # the new rows, and none of the 50,000 Debezium delivered


def test_adopting_50000_rows_as_pending_relays_all_of_them_first(outbox_db, broker):
    aggregate = f"Order{uuid.uuid4().hex[:6]}"
    out, existing = _adopt_50k(outbox_db, broker, aggregate, "--existing", "pending")
    assert "existing rows: pending" in out
    assert scalar(outbox_db, "SELECT count(*) FROM app.outbox_events_relay "
                             "WHERE published_at IS NULL") == 50_000
    new = set()
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        for seq in range(1000, 1050):  # a newer row for every key
            new.add(write(conn, aggregate, f"k-{seq % 50}", "Changed", seq))
    with RelayThread(outbox_db, broker.bootstrap, table="app.outbox_events_relay"):
        wait_until(lambda: scalar(outbox_db, "SELECT count(*) FROM app.outbox_events "
                                             "WHERE relay_published_at IS NULL") == 0,
                   timeout_s=120, message="the table did not drain")
    records = read_all(broker.bootstrap, f"outbox.event.{aggregate}", expected=50_050, timeout_s=120)
    first: dict[str, object] = {}
    for rec in records:
        first.setdefault(rec.headers["event_id"].decode(), rec)
    assert set(first) == existing | new
    # Per key: the existing rows in their order, then the new one.
    last: dict[tuple[int, str], int] = {}
    for rec in sorted(first.values(), key=lambda r: (r.partition, r.offset)):  # type: ignore[attr-defined]
        body = json.loads(rec.value)  # type: ignore[attr-defined]
        scope = (rec.partition, body["key"])  # type: ignore[attr-defined]
        assert body["seq"] > last.get(scope, -1), (scope, body["seq"], last.get(scope))
        last[scope] = body["seq"]
