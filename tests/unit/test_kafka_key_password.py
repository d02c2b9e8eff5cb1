"""A wrong ssl.key.password: librdkafka refuses the configuration when the client is made (no
broker is asked) with OpenSSL's "PEM lib" alone; the relay and the SDK say what to check (an
audit of the security paths found only "PEM lib")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from consumer_sdk import kafka
from consumer_sdk.dead_letters import KafkaDeadLetters
from consumer_sdk.errors import ConfigError as SdkConfigError
from relay.errors import ConfigError
from relay.publisher import Publisher
from tests.fixtures.certs import OPENSSL, _openssl, make_ca

KEY_PASSWORD = "right-key-pw-0123"
WRONG = "wrong-key-pw-4567"
HINT = "the client key could not be read: wrong ssl.key.password, or the key file is not PEM"

pytestmark = pytest.mark.skipif(OPENSSL is None, reason="openssl not installed: apt-get install openssl")


@pytest.fixture(scope="module")
def client_tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A client certificate whose key is encrypted PKCS#8 (passphrase KEY_PASSWORD)."""
    d = tmp_path_factory.mktemp("client-key")
    ca = make_ca(d, "ca")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "plain.key", "-out", "client.pem", "-days", "1", "-subj", "/CN=client", cwd=d)
    _openssl("pkcs8", "-topk8", "-in", "plain.key", "-out", "client.key", "-v2", "aes-256-cbc",
             "-passout", f"pass:{KEY_PASSWORD}", cwd=d)
    return {"bootstrap.servers": "127.0.0.1:1", "security.protocol": "SSL", "ssl.ca.location": str(ca),
            "ssl.certificate.location": str(Path(d, "client.pem")), "ssl.key.location": str(Path(d, "client.key"))}


def _refusal(make: Any) -> str:
    with pytest.raises((ConfigError, SdkConfigError)) as caught:
        make()
    return str(caught.value)


def test_the_relay_says_the_key_could_not_be_read(client_tls: dict[str, str]) -> None:
    message = _refusal(lambda: Publisher({**client_tls, "ssl.key.password": WRONG},
                                         on_client_error=lambda *_: None))
    assert message.startswith("invalid Kafka configuration: ") and message.endswith(HINT), message
    assert WRONG not in message and KEY_PASSWORD not in message


def test_the_sdk_says_the_key_could_not_be_read(client_tls: dict[str, str]) -> None:
    props = {**client_tls, "ssl.key.password": WRONG, "group.id": "g"}
    for make in (lambda: kafka.build_consumer(props),
                 lambda: KafkaDeadLetters(props, topic_template="{topic}.dlq", timeout_s=1)):
        message = _refusal(make)
        assert message.endswith(HINT) and "KafkaError{" not in message, message
        assert WRONG not in message


def test_the_right_password_is_taken(client_tls: dict[str, str]) -> None:
    Publisher({**client_tls, "ssl.key.password": KEY_PASSWORD}, on_client_error=lambda *_: None).close()
