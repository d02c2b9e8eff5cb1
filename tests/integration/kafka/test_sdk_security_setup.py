"""Kafka set-ups that can never work end an SDK consumer, as they end the relay (an audit of
the security paths): TLS against a plaintext listener, a listener that requires a client
certificate the client has not, a principal without READ on its group or its topic, and a
plaintext client against a TLS listener (the relay too).  Before, the InboxConsumer logged
them and ran for ever, consuming nothing.

One Apache Kafka node (StandardAuthorizer) with a PLAINTEXT listener for the tests' admin
client (User:ANONYMOUS, a super user), SASL_SSL and SASL_PLAINTEXT listeners (SCRAM-SHA-512)
and an SSL listener that requires client certificates.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from consumer_sdk.errors import KafkaFatal
from consumer_sdk.metrics import ConsumerMetrics
from outbox_core.kafka_errors import answers_tls, bootstrap_addresses
from tests.fixtures.apache_kafka import ApacheKafkaBroker, admin_client, apache_kafka_or_skip
from tests.fixtures.broker import create_topic
from tests.fixtures.certs import OPENSSL, make_ca, make_server_cert, pem_keystore
from tests.fixtures.outbox import insert_rows, relay_cmd, relay_env
from tests.fixtures.procs import wait_until
from tests.integration.sdk._support import ConsumerThread, migrate_sdk_db

PASSWORD = "setup-pw-" + uuid.uuid4().hex
PREFIX = "sec."
#: Users: READ on the topics and the groups, READ on the topics only, READ on the groups only.
FULL, NO_GROUP, NO_TOPIC = "full", "nogroup", "notopic"
_SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule required;"

pytestmark = pytest.mark.skipif(OPENSSL is None, reason="openssl not installed: apt-get install openssl")


@dataclass(frozen=True)
class Listeners:
    broker: ApacheKafkaBroker
    sasl_ssl: str
    sasl_plaintext: str
    mtls: str
    ca: Path

    def scram(self, protocol: str, user: str = FULL) -> dict[str, str]:
        props = {"security.protocol": protocol, "sasl.mechanism": "SCRAM-SHA-512",
                 "sasl.username": user, "sasl.password": PASSWORD}
        if protocol.endswith("SSL"):
            props["ssl.ca.location"] = str(self.ca)
        return props


def _acl(resource: Any, name: str, pattern: Any, user: str) -> AclBinding:
    return AclBinding(resource, name, pattern, f"User:{user}", "*", AclOperation.READ, AclPermissionType.ALLOW)


@pytest.fixture(scope="module")
def listeners(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Listeners]:
    d = tmp_path_factory.mktemp("kafka-setup")
    ca = make_ca(d, "ca")
    keystore = pem_keystore(d, *make_server_cert(d, "ca", "server"), ca)
    broker = apache_kafka_or_skip(lambda: ApacheKafkaBroker(
        extra_listeners={"SASL_SSL": "SASL_SSL", "SASL_PLAIN": "SASL_PLAINTEXT", "MTLS": "SSL"},
        properties={
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": _SCRAM,
            "listener.name.sasl_plain.scram-sha-512.sasl.jaas.config": _SCRAM,
            "listener.name.sasl_ssl.ssl.keystore.type": "PEM",
            "listener.name.sasl_ssl.ssl.keystore.location": str(keystore),
            "listener.name.mtls.ssl.keystore.type": "PEM",
            "listener.name.mtls.ssl.keystore.location": str(keystore),
            "listener.name.mtls.ssl.truststore.type": "PEM",
            "listener.name.mtls.ssl.truststore.location": str(ca),
            "listener.name.mtls.ssl.client.auth": "required",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:ANONYMOUS",
        }))
    try:
        admin = admin_client(broker.bootstrap)
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
        for f in admin.alter_user_scram_credentials(
                [UserScramCredentialUpsertion(u, info, PASSWORD.encode()) for u in (FULL, NO_GROUP, NO_TOPIC)]).values():
            f.result(timeout=30)
        topics, groups = (ResourceType.TOPIC, PREFIX), (ResourceType.GROUP, "*")
        acls = [_acl(*topics, ResourcePatternType.PREFIXED, FULL), _acl(*groups, ResourcePatternType.LITERAL, FULL),
                _acl(*topics, ResourcePatternType.PREFIXED, NO_GROUP),
                _acl(*groups, ResourcePatternType.LITERAL, NO_TOPIC)]
        for f in admin.create_acls(acls).values():
            f.result(timeout=30)
        del admin
        port = {name: f"127.0.0.1:{ports[0]}" for name, ports in broker.listener_ports.items()}
        yield Listeners(broker=broker, sasl_ssl=port["SASL_SSL"], sasl_plaintext=port["SASL_PLAIN"],
                        mtls=port["MTLS"], ca=ca)
    finally:
        broker.close()


@pytest.fixture
def sdk_dsn(db_dsn: str) -> str:
    return migrate_sdk_db(db_dsn)


@pytest.fixture
def topic(listeners: Listeners, topic_name: Any) -> str:
    name = PREFIX + topic_name("t")
    create_topic(listeners.broker.bootstrap, name, partitions=1)
    return name


def _fatal(dsn: str, bootstrap: str, topic: str, props: dict[str, str], **extra: Any) -> BaseException:
    """Run an InboxConsumer with these settings; the error its run() raised (it must end)."""
    config = InboxConfig(name=f"setup-{uuid.uuid4().hex[:8]}", dsn=dsn, bootstrap_servers=bootstrap,
                         topics=[topic], kafka_properties=props, check_dead_letter_topics=False,
                         check_retention=False, **extra)
    thread = ConsumerThread(InboxConsumer(config, lambda conn, message: None, metrics=ConsumerMetrics())).start()
    try:  # before: logged (kafka_client_error, kafka_consume_error) and ran until stop()
        wait_until(lambda: not thread.thread.is_alive(), timeout_s=45,
                   message=f"the consumer kept running with {props.get('security.protocol')} at {bootstrap}")
    finally:
        thread.consumer.stop()
        thread.thread.join(30)
    assert isinstance(thread.error, KafkaFatal), repr(thread.error)
    assert PASSWORD not in str(thread.error)
    return thread.error


@pytest.mark.parametrize("assignment", ["subscribe", "assign"])
def test_tls_against_a_plaintext_listener_ends_the_consumer(sdk_dsn, listeners, topic, assignment):
    error = _fatal(sdk_dsn, listeners.sasl_plaintext, topic, listeners.scram("SASL_SSL"), assignment=assignment)
    assert str(error).startswith("the TLS handshake with the Kafka cluster failed"), error
    assert "PLAINTEXT broker listener" in str(error)


def test_a_required_client_certificate_missing_ends_the_consumer(sdk_dsn, listeners, topic):
    error = _fatal(sdk_dsn, listeners.mtls, topic, {"security.protocol": "SSL", "ssl.ca.location": str(listeners.ca)})
    assert str(error).startswith("the TLS handshake with the Kafka cluster failed"), error
    assert "certificate required" in str(error)


@pytest.mark.parametrize("assignment", ["subscribe", "assign"])
def test_no_read_on_its_topic_ends_the_consumer_naming_the_acl(sdk_dsn, listeners, topic, assignment):
    error = _fatal(sdk_dsn, listeners.sasl_ssl, topic, listeners.scram("SASL_SSL", NO_TOPIC), assignment=assignment)
    assert "Topic authorization failed" in str(error) and repr(topic) in str(error), error
    assert f"--allow-principal User:{NO_TOPIC} --operation Read --topic {topic}" in str(error)


def test_no_read_on_its_group_ends_the_consumer_naming_the_acl(sdk_dsn, listeners, topic):
    error = _fatal(sdk_dsn, listeners.sasl_ssl, topic, listeners.scram("SASL_SSL", NO_GROUP), group_id="g-no-acl")
    assert "Group authorization failed" in str(error), error
    assert f"--allow-principal User:{NO_GROUP} --operation Read --group g-no-acl" in str(error)


# -- a plaintext client against a TLS listener ----------------------------------------------
# librdkafka said only "1/1 brokers are down" (the listener closes the connection at the
# client's first request), and the relay and the SDK waited for ever, as for a cluster that
# is down (an audit of the security paths).


def test_the_probe_tells_a_tls_listener_from_a_plaintext_one(listeners):
    def answers(bootstrap: str) -> bool:
        host, port = bootstrap_addresses(bootstrap)[0]
        return answers_tls(host, port)

    assert answers(listeners.sasl_ssl) and answers(listeners.mtls)
    assert not answers(listeners.sasl_plaintext) and not answers(listeners.broker.bootstrap)


def test_sasl_plaintext_against_a_tls_listener_ends_the_consumer(sdk_dsn, listeners, topic):
    error = _fatal(sdk_dsn, listeners.sasl_ssl, topic, listeners.scram("SASL_PLAINTEXT"))
    assert str(error).startswith(f"the Kafka listener at {listeners.sasl_ssl} expects TLS"), error
    assert "set it to SASL_SSL" in str(error)


def test_sasl_plaintext_against_a_tls_listener_ends_the_relay_in_one_line(outbox_db, listeners, topic):
    insert_rows(outbox_db, topic, 3)
    env = relay_env(outbox_db, listeners.sasl_ssl)
    env.update({"OUTBOX_RELAY_KAFKA_" + k.upper().replace(".", "_"): v
                for k, v in listeners.scram("SASL_PLAINTEXT").items()})
    result = subprocess.run(relay_cmd("run"), env=env, capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    assert len(lines) == 1 and lines[0].startswith(
        f"outbox-relay: error: the Kafka listener at {listeners.sasl_ssl} expects TLS"), result.stderr
    assert "SASL_SSL" in lines[0] and PASSWORD not in result.stdout + result.stderr
