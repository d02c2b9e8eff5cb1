"""outbox_core.kafka_errors: which client errors end the relay and the SDK, in what words."""

from __future__ import annotations

import threading
import time

from confluent_kafka import KafkaError, KafkaException

from outbox_core import kafka_errors
from outbox_core.kafka_errors import (
    TlsListenerProbe,
    bootstrap_addresses,
    refusal_text,
    setup_failure,
    with_file_hint,
)


def test_bootstrap_addresses_reads_every_form_librdkafka_takes() -> None:
    assert bootstrap_addresses("a:1, sasl_ssl://b:2,[::1]:3,c,,bad:port,d:0") == [
        ("a", 1), ("b", 2), ("::1", 3), ("c", 9092)]


def test_a_tls_transport_error_is_the_set_ups_fault_only_before_any_answer() -> None:
    text = "ssl://h:1/bootstrap: SSL handshake failed: connecting to a PLAINTEXT broker listener?"
    assert setup_failure(KafkaError._TRANSPORT, text, answered=False) == (
        f"the TLS handshake with the Kafka cluster failed: {text}")
    assert setup_failure(KafkaError._TRANSPORT, text, answered=True) is None
    assert setup_failure(KafkaError._TRANSPORT, "Connection refused", answered=False) is None


def test_the_tls_probe_asks_only_for_a_plaintext_client_that_nothing_answered() -> None:
    down, never = KafkaError._ALL_BROKERS_DOWN, "127.0.0.1:1"  # a port nothing listens on: nothing to prove
    plaintext = TlsListenerProbe({"bootstrap.servers": never, "security.protocol": "SASL_PLAINTEXT"})
    assert plaintext.failure(down, "1/1 brokers are down", answered=True) is None
    assert plaintext.failure(KafkaError._TRANSPORT, "Disconnected", answered=False) is None
    tls = TlsListenerProbe({"bootstrap.servers": never, "security.protocol": "SASL_SSL"})
    assert tls.failure(down, "1/1 brokers are down", answered=False) is None


def test_a_probe_that_hangs_holds_the_caller_no_longer_than_its_bound(monkeypatch) -> None:
    # A host name's resolution is not bounded by the socket's timeout: during a DNS outage
    # the probe waited on the resolver, on the relay's loop thread.  Now the caller waits
    # at most PROBE_WAIT_S, and a probe done later is reported at a later call.
    release = threading.Event()

    def resolving_for_long(host: str, port: int) -> bool:
        release.wait(30)
        return True

    down = KafkaError._ALL_BROKERS_DOWN
    monkeypatch.setattr(kafka_errors, "answers_tls", resolving_for_long)
    probe = TlsListenerProbe({"bootstrap.servers": "kafka.example:9092", "security.protocol": "SASL_PLAINTEXT"})
    began = time.monotonic()
    assert probe.failure(down, "1/1 brokers are down", answered=False) is None
    assert time.monotonic() - began < 3.0  # PROBE_WAIT_S (1.5) and a margin
    release.set()
    found = probe.failure(down, "1/1 brokers are down", answered=False)
    assert found == ("the Kafka listener at kafka.example:9092 expects TLS, and security.protocol is "
                     "SASL_PLAINTEXT: set it to SASL_SSL (librdkafka said: 1/1 brokers are down)")


def test_pem_lib_alone_gets_what_to_check() -> None:
    key = "Failed to create producer: ssl.key.location failed: error:0A080009:SSL routines::PEM lib"
    assert with_file_hint(key) == (f"{key}: the client key could not be read: wrong ssl.key.password, "
                                   "or the key file is not PEM")
    pem = "Failed to create consumer: ssl.key.pem failed: error:0A080009:SSL routines::PEM lib"
    assert with_file_hint(pem).endswith("wrong ssl.key.password, or the key file is not PEM")
    cert = "Failed to create producer: ssl.certificate.location failed: error:0A080009:SSL routines::PEM lib"
    assert with_file_hint(cert).endswith("the client certificate could not be read: the file is not a PEM certificate")
    ca = "Failed to create producer: ssl.ca.location failed: error:05880020:x509 certificate routines::BIO lib"
    assert with_file_hint(ca) == ca


def test_a_constructors_refusal_is_one_masked_line_of_librdkafkas_text() -> None:
    exc = KafkaException(KafkaError(KafkaError._INVALID_ARG,
                                    "Failed to create producer: ssl.key.location failed:\n PEM lib s3cret"))
    assert refusal_text(exc, {"ssl.key.password": "s3cret"}) == (
        "Failed to create producer: ssl.key.location failed: PEM lib ***: the client key could not be read: "
        "wrong ssl.key.password, or the key file is not PEM")
