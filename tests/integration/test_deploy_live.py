"""A live relay's /metrics scrape has every metric the dashboard and the alerts query.

tests/unit/test_deploy.py checks the names against the registry's declarations; this
checks them against what a running relay (real PostgreSQL, real broker) really serves
over HTTP, labelled series included.  Labelled series appear only after their first
sample, so the test produces traffic first: rows that publish (events_published), and
one oversized row that fails, is retried once and is dead-lettered (publish_errors,
failed_attempts, dead_lettered).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import yaml
from prometheus_client.parser import text_string_to_metric_families

import relay.migrate
from relay.app import Relay
from relay.config import build_settings
from tests.fixtures.broker import Broker, create_topic
from tests.fixtures.procs import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "outbox-relay.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
METRIC_NAME = re.compile(r"\boutbox_relay_[a-z0-9_]+")

#: librdkafka's smallest allowed message.max.bytes: the oversized row exceeds it, the others do not.
MAX_MESSAGE_BYTES = 1000
#: Series that exist only once something was counted under a label value.
LABELLED = {
    "outbox_relay_events_published_total",
    "outbox_relay_publish_errors_total",
    "outbox_relay_failed_attempts_total",
    "outbox_relay_dead_lettered_total",
}
#: Series that exist only while their state lasts (a partition stalled, a replay active: by
#: replay id), or once it happened to a topic (its partition count changed): a live scrape
#: declares them (HELP and TYPE) without a sample.
DECLARED_ONLY = {"outbox_relay_stalled_rows", "outbox_relay_replay_rows_left",
                 "outbox_relay_replayed_events_total", "outbox_relay_topic_partition_changes_total"}


def dashboard_queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str) and node.get("type") != "datasource":
                yield value
            else:
                yield from dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_queries(item)


def dashboard_metric_names() -> set[str]:
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    return {name for query in queries for name in METRIC_NAME.findall(query)}


def alert_metric_names() -> set[str]:
    (doc,) = yaml.safe_load_all(ALERTS.read_text())
    exprs = [rule["expr"] for group in doc["groups"] for rule in group["rules"]]
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)}


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - a local URL
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scraped_names(port: int) -> set[str]:
    status, body = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    families = list(text_string_to_metric_families(body.decode()))
    declared = {family.name + ("_total" if family.type == "counter" else "") for family in families}
    return {sample.name for family in families for sample in family.samples} | (declared & DECLARED_ONLY)


def insert_rows(dsn: str, topic: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO outbox (topic, key, payload) VALUES (%s, %s, %s)",
                [(topic, f"k{i % 5}", json.dumps({"seq": i})) for i in range(20)],
            )
            # Larger than message.max.bytes: a permanent failure, then a dead letter.
            cur.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'too-big', %s)",
                        (topic, json.dumps({"blob": "x" * (4 * MAX_MESSAGE_BYTES)})))


class RelayOnThread:
    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="relay-deploy-live", daemon=True)

    def _run(self) -> None:
        try:
            self.relay.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"the relay stopped: {self.error!r}") from self.error


def test_live_scrape_has_every_dashboard_and_alert_metric(
        db_dsn: str, broker: Broker, topic_name: Any) -> None:
    relay.migrate.apply(db_dsn)
    topic = topic_name("deploy")
    create_topic(broker.bootstrap, topic, partitions=1)
    insert_rows(db_dsn, topic)

    port = free_port()
    settings = build_settings(
        {"dsn": db_dsn, "bootstrap_servers": broker.bootstrap, "metrics_port": str(port),
         "metrics_host": "127.0.0.1", "poll_interval_s": "0.2", "max_attempts": "2"},
        kafka_properties={"message.max.bytes": str(MAX_MESSAGE_BYTES)},
    )
    runner = RelayOnThread(Relay(settings))
    runner.thread.start()
    try:
        def labelled_series_present() -> set[str] | None:
            runner.check()
            try:
                names = scraped_names(port)
            except OSError:
                return None  # the server is not listening yet
            return names if LABELLED <= names else None

        names = wait_until(
            labelled_series_present, timeout_s=60, interval_s=0.1,
            message=lambda: f"labelled series missing from /metrics: "
                            f"{sorted(LABELLED - _safe_scrape(port))}",
        )
        missing_dashboard = dashboard_metric_names() - names
        assert not missing_dashboard, f"dashboard metrics not scraped: {sorted(missing_dashboard)}"
        missing_alerts = alert_metric_names() - names
        assert not missing_alerts, f"alert metrics not in a live scrape: {sorted(missing_alerts)}"

        # The probes the manifests point at answer on the same port.
        status, body = get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200, body
        status, body = get(f"http://127.0.0.1:{port}/readyz")
        assert status == 200 and json.loads(body)["ok"] is True, body
    finally:
        runner.relay.stop()
        runner.thread.join(timeout=30)
    assert not runner.thread.is_alive(), "the relay did not stop within 30 s"
    runner.check()


def _safe_scrape(port: int) -> set[str]:
    try:
        return scraped_names(port)
    except (OSError, AssertionError):
        return set()

