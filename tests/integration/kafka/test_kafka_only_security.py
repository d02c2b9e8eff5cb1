"""SASL/SCRAM-SHA-512 over TLS and ACLs on Apache Kafka (issue 13): what tansu cannot carry.

One Apache Kafka node with two listeners: PLAINTEXT, where the tests' admin client is
User:ANONYMOUS and a super user, and SASL_SSL (SCRAM-SHA-512, a certificate from a CA made
here), where the relay and the SDK's consumer log in as SCRAM users created through the
AdminClient.  StandardAuthorizer enforces ACLs: with no ACL, nothing is allowed.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from consumer_sdk import InboxConfig, InboxConsumer
from consumer_sdk.metrics import ConsumerMetrics
from tests.fixtures.apache_kafka import ApacheKafkaBroker, admin_client, apache_kafka_or_skip
from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.certs import OPENSSL, make_ca, make_server_cert, pem_keystore
from tests.fixtures.outbox import (
    all_event_ids,
    check_delivery,
    insert_rows,
    relay_cmd,
    relay_env,
    wait_drained,
)
from tests.fixtures.procs import wait_until
from tests.integration.sdk._support import ConsumerThread, migrate_sdk_db, record_effect

RELAY_PASSWORD = "relay-pw-" + uuid.uuid4().hex  # unique strings to grep for
CONSUMER_PASSWORD = "consumer-pw-" + uuid.uuid4().hex
WRONG_PASSWORD = "wrong-pw-" + uuid.uuid4().hex
ALLOWED_PREFIX = "allowed."

pytestmark = pytest.mark.skipif(OPENSSL is None, reason="openssl not installed: apt-get install openssl")


@dataclass(frozen=True)
class SecureKafka:
    broker: ApacheKafkaBroker
    sasl_bootstrap: str
    ca: Path

    def client(self, user: str, password: str) -> dict[str, str]:
        """librdkafka properties of a SCRAM-SHA-512 client over TLS."""
        return {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                "sasl.username": user, "sasl.password": password,
                "ssl.ca.location": str(self.ca)}

    def relay_env(self, dsn: str, password: str, **extra: Any) -> dict[str, str]:
        env = relay_env(dsn, self.sasl_bootstrap, **extra)
        env.update({"OUTBOX_RELAY_KAFKA_" + k.upper().replace(".", "_"): v
                    for k, v in self.client("relay", password).items()})
        return env


def _acl(resource: Any, name: str, pattern: Any, user: str, op: Any) -> AclBinding:
    return AclBinding(resource, name, pattern, f"User:{user}", "*", op, AclPermissionType.ALLOW)


@pytest.fixture(scope="module")
def secure_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    d = tmp_path_factory.mktemp("kafka-tls")
    ca = make_ca(d, "ca")
    cert, key = make_server_cert(d, "ca", "server")
    keystore = pem_keystore(d, cert, key, ca)
    broker = apache_kafka_or_skip(lambda: ApacheKafkaBroker(
        extra_listeners={"SASL_SSL": "SASL_SSL"},
        properties={
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.sasl_ssl.ssl.keystore.type": "PEM",
            "listener.name.sasl_ssl.ssl.keystore.location": str(keystore),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:ANONYMOUS",
            "num.partitions": "3",
        }))
    try:
        admin = admin_client(broker.bootstrap)
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
        futures = admin.alter_user_scram_credentials([
            UserScramCredentialUpsertion("relay", info, RELAY_PASSWORD.encode()),
            UserScramCredentialUpsertion("consumer", info, CONSUMER_PASSWORD.encode()),
        ])
        for f in futures.values():
            f.result(timeout=30)
        acls = [
            _acl(ResourceType.TOPIC, ALLOWED_PREFIX, ResourcePatternType.PREFIXED, "relay",
                 AclOperation.WRITE),
            _acl(ResourceType.TOPIC, ALLOWED_PREFIX, ResourcePatternType.PREFIXED, "consumer",
                 AclOperation.READ),
            _acl(ResourceType.GROUP, "*", ResourcePatternType.LITERAL, "consumer",
                 AclOperation.READ),
        ]
        for f in admin.create_acls(acls).values():
            f.result(timeout=30)
        del admin
        port = broker.listener_ports["SASL_SSL"][0]
        yield SecureKafka(broker=broker, sasl_bootstrap=f"127.0.0.1:{port}", ca=ca)
    finally:
        broker.close()


def run_relay(env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(relay_cmd("run"), env=env, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def assert_no_password(text: str, where: str) -> None:
    for secret in (RELAY_PASSWORD, CONSUMER_PASSWORD, WRONG_PASSWORD):
        assert secret not in text, f"a password leaked in {where}"


def test_relay_publishes_with_scram_sha_512_over_tls(outbox_db, secure_kafka, spawn, topic_name):
    topic = ALLOWED_PREFIX + topic_name("scram")
    create_topic(secure_kafka.broker.bootstrap, topic, partitions=3)
    insert_rows(outbox_db, topic, 200, keys=20)
    expected = all_event_ids(outbox_db)
    relay = spawn(relay_cmd("run"), env=secure_kafka.relay_env(outbox_db, RELAY_PASSWORD,
                                                               log_level="debug"),
                  name="relay-scram")
    wait_drained(outbox_db, timeout_s=60)
    delivery = check_delivery(read_all(secure_kafka.broker.bootstrap, topic, expected), expected)
    assert not delivery.missing and not delivery.order_violations and delivery.duplicates == 0
    relay.sigterm()
    assert relay.wait(30) == 0, relay.log_tail()
    log = relay.log_text()
    assert "Traceback" not in log
    assert '"sasl.password": "***"' in log
    assert_no_password(log, "the relay's debug log")
    assert_no_password(secure_kafka.broker.log_path.read_text(), "the broker's log")


@pytest.mark.parametrize("mode", ["default", "exactly-once"])
def test_relay_refuses_a_wrong_scram_password_in_one_line(outbox_db, secure_kafka, topic_name, mode):
    # In exactly-once mode the relay waited for ever, saying only "Broker transport failure"
    # about its position topic (an audit of the security paths).
    insert_rows(outbox_db, ALLOWED_PREFIX + topic_name("wrong"), 5)
    eo = {} if mode == "default" else {
        "exactly_once": "true", "exactly_once_position_topic": ALLOWED_PREFIX + topic_name("pos"),
        "exactly_once_transactional_id_prefix": ALLOWED_PREFIX + topic_name("txn") + "."}
    result = run_relay(secure_kafka.relay_env(outbox_db, WRONG_PASSWORD, **eo))
    out = result.stdout + result.stderr
    # README "Failures and exit codes": a refusal by the Kafka cluster is one line; the
    # relay's FatalError exits 1 (exit 4 is the database's AuthenticationFailed).
    assert result.returncode == 1, out[-3000:]
    assert "Traceback" not in out
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("outbox-relay: error: the Kafka cluster rejected the credentials (SASL)")
    assert_no_password(out, "the relay's output")
    assert_no_password(secure_kafka.broker.log_path.read_text(), "the broker's log")
    assert int(psycopg.connect(outbox_db).execute(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()[0]) == 5


def test_relay_refuses_tls_against_a_plaintext_listener_in_one_line(outbox_db, secure_kafka, topic_name):
    """A TLS set-up that cannot work, reported by librdkafka as a transport error: the
    relay waited for it for ever, as for a broker that is down (an audit of the security
    paths).  README: a TLS handshake that failed is one line, exit 1."""
    insert_rows(outbox_db, ALLOWED_PREFIX + topic_name("plain"), 5)
    env = secure_kafka.relay_env(outbox_db, RELAY_PASSWORD)
    env["OUTBOX_RELAY_BOOTSTRAP_SERVERS"] = secure_kafka.broker.bootstrap  # the PLAINTEXT listener
    result = run_relay(env)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("outbox-relay: error: the TLS handshake with the Kafka "
                                                   "cluster failed"), result.stderr
    assert "PLAINTEXT broker listener" in lines[0]
    assert_no_password(out, "the relay's output")


def _consumer(secure: SecureKafka, dsn: str, topic: str, password: str) -> InboxConsumer:
    config = InboxConfig(name=f"scram-{uuid.uuid4().hex[:8]}", dsn=dsn,
                         bootstrap_servers=secure.sasl_bootstrap, topics=[topic],
                         kafka_properties=secure.client("consumer", password),
                         check_dead_letter_topics=False, check_retention=False)
    return InboxConsumer(config, lambda conn, message: record_effect(conn, message),
                         metrics=ConsumerMetrics())


def test_inbox_consumer_reads_with_scram_and_refuses_a_wrong_password(db_dsn, secure_kafka,
                                                                     topic_name, capfd):
    sdk_db = migrate_sdk_db(db_dsn)
    topic = ALLOWED_PREFIX + topic_name("sdk")
    create_topic(secure_kafka.broker.bootstrap, topic, partitions=3)
    insert_rows(sdk_db, topic, 50, keys=5)
    expected = all_event_ids(sdk_db)
    relay_env_ = secure_kafka.relay_env(sdk_db, RELAY_PASSWORD)
    relay = subprocess.Popen(relay_cmd("run"), env=relay_env_, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        wait_drained(sdk_db, timeout_s=60)
    finally:
        relay.terminate()
        relay.wait(30)

    good = ConsumerThread(_consumer(secure_kafka, sdk_db, topic, CONSUMER_PASSWORD)).start()
    try:
        wait_until(lambda: _effects(sdk_db) >= len(expected), timeout_s=60,
                   message=lambda: f"{_effects(sdk_db)} of {len(expected)} effects")
    finally:
        good.consumer.stop()
        good.thread.join(30)
    assert _effects(sdk_db) == len(expected)

    # A wrong password: the SDK logs librdkafka's SASL rejection (`kafka_fatal`, structlog's
    # output on stdout; librdkafka's own lines no longer go raw to stderr), without the
    # password, and stops; nothing is consumed or committed.
    capfd.readouterr()
    seen: list[str] = []

    def read() -> str:
        out, err = capfd.readouterr()
        return out + err

    bad = ConsumerThread(_consumer(secure_kafka, sdk_db, topic, WRONG_PASSWORD)).start()
    try:
        wait_until(lambda: seen.append(read()) or "SASL authentication error"
                   in "".join(seen), timeout_s=60,
                   message=lambda: f"no SASL rejection logged: {''.join(seen)[-2000:]}")
    finally:
        bad.consumer.stop()
        bad.thread.join(30)
    seen.append(read())
    assert "Authentication failed" in "".join(seen)
    assert_no_password("".join(seen), "the consumer's log")
    assert _effects(sdk_db) == len(expected)


def test_inbox_consumer_stops_on_a_wrong_password(db_dsn, secure_kafka, topic_name):
    sdk_db = migrate_sdk_db(db_dsn)
    topic = ALLOWED_PREFIX + topic_name("sdk-wrong")
    create_topic(secure_kafka.broker.bootstrap, topic, partitions=1)
    bad = ConsumerThread(_consumer(secure_kafka, sdk_db, topic, WRONG_PASSWORD)).start()
    try:
        wait_until(lambda: not bad.thread.is_alive(), timeout_s=20,
                   message="the consumer with a wrong password kept running")
    finally:
        bad.consumer.stop()
        bad.thread.join(30)
    assert bad.error is not None and "Authentication failed" in str(bad.error)


def _effects(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute("SELECT count(*) FROM effects").fetchone()[0])  # type: ignore[index]


def test_a_topic_the_principal_may_not_write_is_dead_lettered_and_others_flow(
        outbox_db, secure_kafka, spawn, topic_name):
    allowed = ALLOWED_PREFIX + topic_name("ok")
    denied = "denied." + topic_name("no-acl")
    create_topic(secure_kafka.broker.bootstrap, allowed, partitions=3)
    create_topic(secure_kafka.broker.bootstrap, denied, partitions=3)
    insert_rows(outbox_db, denied, 3, keys=3)
    insert_rows(outbox_db, allowed, 100, keys=10, start=3)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        allowed_ids = {str(r[0]) for r in conn.execute(
            "SELECT event_id FROM outbox WHERE topic = %s", (allowed,))}
    relay = spawn(relay_cmd("run"), env=secure_kafka.relay_env(
        outbox_db, RELAY_PASSWORD, max_attempts=2, backoff_max_s=0.5), name="relay-acl")
    records = read_all(secure_kafka.broker.bootstrap, allowed, allowed_ids, timeout_s=60)
    delivery = check_delivery(records, allowed_ids)
    assert not delivery.missing and not delivery.order_violations
    dead = wait_until(lambda: (d := _dead_letters(outbox_db)) and len(d) == 3 and d,
                      timeout_s=60, message=lambda: f"dead letters: {_dead_letters(outbox_db)}")
    assert {d["topic"] for d in dead} == {denied}
    assert {d["reason"] for d in dead} == {"topic_not_authorized"}, dead
    assert read_all(secure_kafka.broker.bootstrap, denied, 1, timeout_s=2) == []
    relay.sigterm()
    assert relay.wait(30) == 0, relay.log_tail()


def _dead_letters(dsn: str) -> list[dict[str, Any]]:
    import json

    out = subprocess.run(relay_cmd("dead-letters", "list", "--json", "--dsn", dsn),
                         capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def test_the_sdks_dead_letters_go_once_the_principal_may_write_them(secure_kafka, topic_name):
    """A consumer's principal without WRITE (a read-only consumer): the idempotent
    dead-letter producer got librdkafka's fatal error at its first letter, and kept it: after
    WRITE was granted every letter still failed ("Local: Fatal error") until a restart, where
    the runbook promises the next retry sends it, and close() raised a raw KafkaException
    (an audit of the security paths).  The producer is replaced after a fatal error."""
    from consumer_sdk.dead_letters import KafkaDeadLetters
    from consumer_sdk.errors import DeadLetterFailed
    from consumer_sdk.model import DeadLetter, KafkaRecord

    user, password = f"dlq-{uuid.uuid4().hex[:8]}", "dlq-password-0123456789"
    admin = admin_client(secure_kafka.broker.bootstrap)
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
    for f in admin.alter_user_scram_credentials([UserScramCredentialUpsertion(user, info, password.encode())]).values():
        f.result(timeout=30)
    source = ALLOWED_PREFIX + topic_name("src")
    dlq = source + ".dlq"
    create_topic(secure_kafka.broker.bootstrap, dlq, partitions=1)
    # A consumer's rights: READ (and so DESCRIBE) on its topics, no WRITE anywhere.
    for f in admin.create_acls([_acl(ResourceType.TOPIC, ALLOWED_PREFIX, ResourcePatternType.PREFIXED, user,
                                     AclOperation.READ)]).values():
        f.result(timeout=30)
    letters = KafkaDeadLetters({**secure_kafka.client(user, password), "bootstrap.servers": secure_kafka.sasl_bootstrap},
                               topic_template="{topic}.dlq", timeout_s=10)
    letter = DeadLetter(record=KafkaRecord(topic=source, partition=0, offset=7, key=b"k", value=b"v"),
                        consumer="c", reason="permanent_error", error="boom", error_type="PermanentError", attempts=1)
    with pytest.raises(DeadLetterFailed):
        letters.send(letter)
    for f in admin.create_acls([_acl(ResourceType.TOPIC, dlq, ResourcePatternType.LITERAL, user,
                                     AclOperation.WRITE)]).values():
        f.result(timeout=30)

    failures: list[str] = []

    def sent() -> bool:
        try:
            letters.send(letter)
        except DeadLetterFailed as exc:
            failures.append(str(exc))
            return False
        return True

    wait_until(sent, timeout_s=60, interval_s=1.0,
               message=lambda: f"the letter sent once WRITE was granted; {failures[:1]} ... {failures[-1:]}")
    letters.close()
    assert len(read_all(secure_kafka.broker.bootstrap, dlq, 1, timeout_s=30)) >= 1
