"""The SDK's own Kafka clients: an error in the consumer's kafka_properties is named as the
consumer's (it was reported as the dead-letter producer's, made first with the same
properties), and librdkafka's own lines go through logging, never raw to stderr (an audit of
the security paths).  No broker is needed: the addresses are ports nothing listens on."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from consumer_sdk import InboxConfig, InboxConsumer
from consumer_sdk.dead_letters import KafkaDeadLetters
from consumer_sdk.errors import ConfigError, DeadLetterFailed
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import DeadLetter, KafkaRecord
from tests.fixtures.procs import free_port, wait_until
from tests.integration.sdk._support import ConsumerThread
from tests.unit.test_publisher_close import rdkafka_threads


def _consumer(dsn: str, check_retention: bool = False, **props: Any) -> InboxConsumer:
    config = InboxConfig(name="client-config", dsn=dsn, bootstrap_servers=f"127.0.0.1:{free_port()}", topics=["t"],
                         kafka_properties=props, check_dead_letter_topics=False, check_retention=check_retention)
    return InboxConsumer(config, lambda conn, message: None, metrics=ConsumerMetrics())


def test_an_error_in_the_consumers_properties_names_the_consumer(sdk_db: str) -> None:
    with pytest.raises(ConfigError) as caught:  # by InboxConfig now; it was by run()
        _consumer(sdk_db, **{"security.protocol": "SSL", "ssl.ca.location": "/nonexistent/ca.pem"}).run()
    message = str(caught.value)
    assert message.startswith("invalid Kafka consumer configuration: "), message  # before: "... for the dead-letter producer"
    assert "dead-letter" not in message and "ssl.ca.location" in message


def _letter() -> DeadLetter:
    return DeadLetter(record=KafkaRecord(topic="t", partition=0, offset=7, key=b"k", value=b"v"), consumer="c",
                      reason="permanent_error", error="boom", error_type="PermanentError", attempts=1)


def test_the_dead_letter_producers_own_lines_are_not_printed_raw(capfd: pytest.CaptureFixture[str]) -> None:
    letters = KafkaDeadLetters({"bootstrap.servers": f"127.0.0.1:{free_port()}"}, topic_template="{topic}.dlq",
                               timeout_s=3)
    with pytest.raises(DeadLetterFailed) as caught:
        letters.send(_letter())
    letters.close(0)
    err = capfd.readouterr().err
    assert "%3|" not in err and "|FAIL|" not in err, err[-2000:]  # before: librdkafka's lines, raw
    assert "Connection refused" in str(caught.value)  # what they said, in the error instead


@pytest.mark.parametrize("check_retention", [False, True], ids=["consumer", "retention-check"])
def test_the_consumers_own_lines_are_not_printed_raw(sdk_db: str, capfd: pytest.CaptureFixture[str],
                                                     check_retention: bool) -> None:
    consumer = _consumer(sdk_db, check_retention=check_retention)
    thread = ConsumerThread(consumer)
    # The retention check's admin client asks the cluster at start, for up to 10 s.
    event = "inbox_retention_unchecked" if check_retention else "kafka_client_error"
    with capture_logs() as logs:
        thread.start()
        try:
            wait_until(lambda: any(e["event"] == event for e in logs), timeout_s=30,
                       message=f"no {event} logged for a port nothing listens on")
        finally:
            thread.stop()
    err = capfd.readouterr().err
    assert "%3|" not in err and "|FAIL|" not in err, err[-2000:]


def test_a_closed_dead_letter_producer_leaves_no_client_thread() -> None:
    before = rdkafka_threads()
    letters = KafkaDeadLetters({"bootstrap.servers": f"127.0.0.1:{free_port()}"}, topic_template="{topic}.dlq",
                               timeout_s=1)
    assert rdkafka_threads() > before
    with pytest.raises(DeadLetterFailed):
        letters.send(_letter())
    letters.close(0)
    letters.close(0)  # idempotent
    assert rdkafka_threads() <= before  # before: alive until a cyclic garbage collection
    with pytest.raises(RuntimeError, match="closed"):
        letters.send(_letter())
