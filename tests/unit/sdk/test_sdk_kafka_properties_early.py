"""InboxConfig has librdkafka check the consumer's properties when it is made: a misspelled
property or a value librdkafka refuses raised only in start(), at run time (perhaps on
another thread), though the rest of the configuration is checked at construction.  The
message is start()'s: "invalid Kafka consumer configuration: ..." naming the property."""

from __future__ import annotations

from typing import Any

import pytest

from consumer_sdk import ConfigError, InboxConfig
from consumer_sdk.kafka_properties import offline
from tests.unit.test_publisher_close import rdkafka_threads


def _config(**props: Any) -> InboxConfig:
    return InboxConfig(name="svc", dsn="postgresql://x", bootstrap_servers="127.0.0.1:1", topics=["t"],
                       kafka_properties=props)


@pytest.mark.parametrize(("props", "named"), [
    ({"fetch.wait.max.msx": 50}, 'No such configuration property: "fetch.wait.max.msx"'),
    ({"auto.offset.reset": "earlist"}, 'Invalid value "earlist" for configuration property "auto.offset.reset"'),
    ({"session.timeout.ms": "six"}, 'configuration property "session.timeout.ms"'),
    ({"session.timeout.ms": -1}, '"session.timeout.ms" value -1 is outside allowed range'),
    ({"security.protocol": "SSL", "ssl.ca.location": "/nonexistent/ca.pem"}, "ssl.ca.location failed"),
    ({"oauth_cb": "not a function"}, "expected oauth_cb property as a callable function"),
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER", "sasl.oauthbearer.method": "oidc"},
     "`sasl.oauthbearer.token.endpoint.url` is mandatory"),
], ids=["unknown", "enum", "number", "range", "missing-file", "callback", "oidc"])
def test_a_property_librdkafka_refuses_raises_at_construction(props: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as caught:  # before: InboxConfig took it; start() raised
        _config(**props)
    message = str(caught.value)
    assert message.startswith("invalid Kafka consumer configuration: ") and named in message, message
    assert "KafkaError{" not in message and "\n" not in message, message


def test_the_check_leaves_no_client_behind_and_good_properties_pass() -> None:
    before = rdkafka_threads()
    config = _config(**{"fetch.wait.max.ms": 50, "session.timeout.ms": 6000, "client.id": "svc-1",
                        "security.protocol": "SSL"})
    assert config.consumer_kafka()["fetch.wait.max.ms"] == 50
    assert rdkafka_threads() == before


def test_no_credential_is_asked_for_at_construction() -> None:
    """confluent-kafka calls an oauth_cb when a SASL client is made: not for the check."""
    calls: list[Any] = []

    def token(config: Any) -> tuple[str, float]:
        calls.append(config)
        return "token", 1e12

    _config(**{"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER", "oauth_cb": token})
    assert calls == []


@pytest.mark.parametrize(("given", "checked"), [
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"},
     {"security.protocol": "ssl", "sasl.mechanism": "OAUTHBEARER"}),
    ({"security.protocol": "sasl_plaintext"}, {"security.protocol": "plaintext"}),  # GSSAPI, librdkafka's default
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512"},
     {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512"}),
    ({"security.protocol": "SSL", "sasl.mechanism": "OAUTHBEARER"},
     {"security.protocol": "SSL", "sasl.mechanism": "OAUTHBEARER"}),
])
def test_the_checked_client_reaches_no_broker_and_asks_no_credential(given: dict[str, Any],
                                                                      checked: dict[str, Any]) -> None:
    props = offline({"bootstrap.servers": "k:9092", "group.id": "g", "oauth_cb": print, **given})
    assert props == {"group.id": "g", **checked}
