"""The example service (examples/service.py) works end to end."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import psycopg

from tests.fixtures.broker import read_all
from tests.integration.sdk._support import make_config, publish_all, wait_settled

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "service.py"


def test_example_service_both_ends(sdk_db, broker, sdk_topic, run_consumer, monkeypatch):
    spec = importlib.util.spec_from_file_location("example_service", EXAMPLE)
    assert spec is not None and spec.loader is not None
    service = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(service)
    monkeypatch.setattr(service, "TOPIC", sdk_topic)
    with psycopg.connect(sdk_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, total numeric);"
                     "CREATE TABLE revenue (day date PRIMARY KEY, total numeric)")
        service.place_order(conn, 1, 9.5)
        service.place_order(conn, 2, 0.5)
        service.place_order(conn, 3, -1)
    publish_all(sdk_db, broker.bootstrap, times=2)  # every event arrives twice

    thread = run_consumer(make_config(sdk_db, broker, sdk_topic), service.add_revenue)
    wait_settled(thread, 6)
    thread.stop()
    with psycopg.connect(sdk_db) as conn:
        assert conn.execute("SELECT total FROM revenue").fetchone() == (10,)
    letters = read_all(broker.bootstrap, f"{sdk_topic}.dlq", expected=2, timeout_s=20)
    assert [json.loads(r.value)["id"] for r in letters] == [3, 3]  # dead letters are at-least-once
