"""TLS set-ups that can never work end an exactly-once relay as they end a default one: one
line, exit 1 (README "Failures and exit codes").  TLS against a plaintext listener, a listener
that requires a client certificate the client has not, a CA that did not sign the broker's
certificate, and a plaintext client against a TLS listener.  In exactly-once mode the relay's
plain producer (dead letters, replays) is made and connected before any transactional
producer or position-topic client, with the same security properties, so its error callback
(outbox_core.kafka_errors) ends the relay first; these tests keep it so.

One Apache Kafka node with its PLAINTEXT listener and an SSL listener that requires client
certificates.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.fixtures.apache_kafka import ApacheKafkaBroker, apache_kafka_or_skip
from tests.fixtures.certs import OPENSSL, make_ca, make_server_cert, pem_keystore
from tests.fixtures.outbox import insert_rows, relay_cmd, relay_env

pytestmark = pytest.mark.skipif(OPENSSL is None, reason="openssl not installed: apt-get install openssl")

TLS_FAILED = "outbox-relay: error: the TLS handshake with the Kafka cluster failed"


@dataclass(frozen=True)
class TlsKafka:
    broker: ApacheKafkaBroker
    mtls: str
    ca: Path
    other_ca: Path


@pytest.fixture(scope="module")
def tls_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsKafka]:
    d = tmp_path_factory.mktemp("kafka-eo-tls")
    ca = make_ca(d, "ca")
    other_ca = make_ca(d, "other")
    keystore = pem_keystore(d, *make_server_cert(d, "ca", "server"), ca)
    broker = apache_kafka_or_skip(lambda: ApacheKafkaBroker(
        extra_listeners={"MTLS": "SSL"},
        properties={
            "listener.name.mtls.ssl.keystore.type": "PEM",
            "listener.name.mtls.ssl.keystore.location": str(keystore),
            "listener.name.mtls.ssl.truststore.type": "PEM",
            "listener.name.mtls.ssl.truststore.location": str(ca),
            "listener.name.mtls.ssl.client.auth": "required",
        }))
    try:
        yield TlsKafka(broker=broker, mtls=f"127.0.0.1:{broker.listener_ports['MTLS'][0]}",
                       ca=ca, other_ca=other_ca)
    finally:
        broker.close()


def _run_relay(dsn: str, bootstrap: str, ca: Path, mode: str, topic_name) -> subprocess.CompletedProcess[str]:
    eo = {} if mode == "default" else {
        "exactly_once": "true", "exactly_once_position_topic": topic_name("pos"),
        "exactly_once_transactional_id_prefix": topic_name("txn") + "."}
    env = relay_env(dsn, bootstrap, **eo)
    env.update({"OUTBOX_RELAY_KAFKA_SECURITY_PROTOCOL": "SSL", "OUTBOX_RELAY_KAFKA_SSL_CA_LOCATION": str(ca)})
    return subprocess.run(relay_cmd("run"), env=env, capture_output=True, text=True, timeout=90,
                          stdin=subprocess.DEVNULL)


def _assert_one_tls_line(result: subprocess.CompletedProcess[str], dsn: str) -> str:
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert "Traceback" not in out
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(TLS_FAILED), result.stderr[-3000:]
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()
    assert row is not None and row[0] == 3
    return lines[0]


@pytest.mark.parametrize("mode", ["default", "exactly-once"])
def test_tls_against_a_plaintext_listener_is_one_line(outbox_db, tls_kafka, topic_name, mode):
    insert_rows(outbox_db, topic_name("plain"), 3)
    result = _run_relay(outbox_db, tls_kafka.broker.bootstrap, tls_kafka.ca, mode, topic_name)
    assert "PLAINTEXT broker listener" in _assert_one_tls_line(result, outbox_db)


@pytest.mark.parametrize("mode", ["default", "exactly-once"])
def test_a_missing_client_certificate_is_one_line(outbox_db, tls_kafka, topic_name, mode):
    insert_rows(outbox_db, topic_name("mtls"), 3)
    result = _run_relay(outbox_db, tls_kafka.mtls, tls_kafka.ca, mode, topic_name)
    assert "certificate required" in _assert_one_tls_line(result, outbox_db)


@pytest.mark.parametrize("mode", ["default", "exactly-once"])
def test_a_ca_that_did_not_sign_the_broker_is_one_line(outbox_db, tls_kafka, topic_name, mode):
    insert_rows(outbox_db, topic_name("ca"), 3)
    result = _run_relay(outbox_db, tls_kafka.mtls, tls_kafka.other_ca, mode, topic_name)
    assert "certificate verify failed" in _assert_one_tls_line(result, outbox_db)


@pytest.mark.parametrize("mode", ["default", "exactly-once"])
def test_plaintext_against_a_tls_listener_is_one_line(outbox_db, tls_kafka, topic_name, mode):
    insert_rows(outbox_db, topic_name("tls"), 3)
    eo = {} if mode == "default" else {
        "exactly_once": "true", "exactly_once_position_topic": topic_name("pos"),
        "exactly_once_transactional_id_prefix": topic_name("txn") + "."}
    result = subprocess.run(relay_cmd("run"), env=relay_env(outbox_db, tls_kafka.mtls, **eo),
                            capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    assert len(lines) == 1 and lines[0].startswith(
        f"outbox-relay: error: the Kafka listener at {tls_kafka.mtls} expects TLS"), result.stderr[-3000:]
    assert "set it to SSL" in lines[0]
