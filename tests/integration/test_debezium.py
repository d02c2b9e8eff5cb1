"""Drop-in interop (issue 6): an existing Debezium outbox-router table relayed end to end
with its routing, its writers unchanged."""

from __future__ import annotations

import json
import subprocess
import uuid

import psycopg

from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import RelayThread, relay_cmd, scalar
from tests.fixtures.procs import wait_until

DEBEZIUM_TABLE = """
CREATE TABLE app.outbox_events (
    id uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb
)"""


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
                                       "app.outbox_events", "--cloudevents-source", "/orders-service"),
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
        assert relay.metrics.registry.get_sample_value(
            "outbox_relay_events_published_total", {"topic": f"outbox.event.{order_type}"}) == 201
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
    for template in ("x.{payload}", "x.{aggregatetype'); DROP TABLE outbox; --}", "x}{"):
        result = subprocess.run(relay_cmd("migrate", "--dsn", outbox_db, "--debezium-table",
                                          "app.outbox_events", "--topic-template", template),
                                capture_output=True, text=True)
        assert result.returncode == 2, (template, result.stderr)
        assert "--topic-template" in result.stderr and "Traceback" not in result.stderr
    assert scalar(outbox_db, "SELECT to_regclass('outbox') IS NOT NULL") is True
