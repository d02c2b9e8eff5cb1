"""The SDK's own Kafka clients: an error in the consumer's kafka_properties is named as the
consumer's (it was reported as the dead-letter producer's, made first with the same
properties), and librdkafka's own lines go through logging, never raw to stderr (an audit of
the security paths).  No broker is needed: the addresses are ports nothing listens on."""

from __future__ import annotations

from typing import Any

import pytest

from consumer_sdk import InboxConfig, InboxConsumer
from consumer_sdk.errors import ConfigError
from consumer_sdk.metrics import ConsumerMetrics


def _consumer(dsn: str, **props: Any) -> InboxConsumer:
    config = InboxConfig(name="client-config", dsn=dsn, bootstrap_servers="127.0.0.1:1", topics=["t"],
                         kafka_properties=props, check_dead_letter_topics=False, check_retention=False)
    return InboxConsumer(config, lambda conn, message: None, metrics=ConsumerMetrics())


def test_an_error_in_the_consumers_properties_names_the_consumer(sdk_db: str) -> None:
    consumer = _consumer(sdk_db, **{"security.protocol": "SSL", "ssl.ca.location": "/nonexistent/ca.pem"})
    with pytest.raises(ConfigError) as caught:
        consumer.run()
    message = str(caught.value)
    assert message.startswith("invalid Kafka consumer configuration: "), message  # before: "... for the dead-letter producer"
    assert "dead-letter" not in message and "ssl.ca.location" in message
