"""A dead letter that cannot be produced, on a real broker: the handler never runs again,
the partition waits paused, the others flow; a record as large as its source topic carries
is dead-lettered; a missing dead-letter topic is found at start-up."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pytest

from consumer_sdk import ConfigError, InboxConsumer, InboxMessage, PermanentError
from consumer_sdk.metrics import ConsumerMetrics
from tests.fixtures.broker import create_topic, read_all
from tests.integration.sdk._support import make_config, produce_raw, wait_for, wait_settled

BIG = 1_500_000  # past librdkafka's default message.max.bytes (1 MB)


def _headers() -> list[tuple[str, bytes]]:
    return [("event_id", str(uuid.uuid4()).encode())]


def test_a_missing_dead_letter_topic_is_found_at_start_up(sdk_db, broker, topic_name):
    topic = topic_name("nodlq")
    create_topic(broker.bootstrap, topic, partitions=1)
    consumer = InboxConsumer(make_config(sdk_db, broker, topic), lambda conn, message: None)
    with pytest.raises(ConfigError, match=rf"dead-letter topic {topic}\.dlq does not exist"):
        consumer.start()
    consumer.close()


def test_a_record_as_large_as_its_topic_carries_is_dead_lettered_once(sdk_db, broker, sdk_topic, run_consumer):
    produce_big = [(b"k", b"x" * BIG, _headers())]
    from confluent_kafka import Producer  # the source producer allows big records, as the relay may

    producer = Producer({"bootstrap.servers": broker.bootstrap, "message.max.bytes": 4_000_000})
    for key, value, headers in produce_big:
        producer.produce(sdk_topic, key=key, value=value, headers=headers, partition=0)
    assert producer.flush(15) == 0
    calls: Counter[int] = Counter()

    def handler(conn: Any, message: InboxMessage) -> None:
        calls[message.offset] += 1
        raise PermanentError("this one can never work")

    thread = run_consumer(make_config(sdk_db, broker, sdk_topic, db_backoff_initial_s=0.05,
                                      db_backoff_max_s=0.2), handler)
    wait_settled(thread, 1)
    [letter] = read_all(broker.bootstrap, f"{sdk_topic}.dlq", expected=1, timeout_s=20)
    thread.stop()
    assert len(letter.value or b"") == BIG and calls == {0: 1}
    assert thread.sample("outbox_consumer_dead_letter_failures_total",
                         consumer=thread.consumer.config.name, topic=sdk_topic) == 0


def test_a_refused_dead_letter_pauses_its_partition_and_never_reruns_the_handler(
        sdk_db, broker, sdk_topic, run_consumer):
    produce_raw(broker.bootstrap, sdk_topic, [(b"a", b"y" * 5000, _headers())], partition=0)
    produce_raw(broker.bootstrap, sdk_topic, [(b"b", b"{}", _headers()) for _ in range(3)], partition=1)
    calls: Counter[tuple[int, int]] = Counter()

    def handler(conn: Any, message: InboxMessage) -> None:
        calls[(message.partition, message.offset)] += 1
        if message.partition == 0:
            raise PermanentError("rejected")

    metrics = ConsumerMetrics()
    config = make_config(sdk_db, broker, sdk_topic, dead_letter_max_bytes=1000,  # the letter cannot go
                         db_backoff_initial_s=0.05, db_backoff_max_s=0.1)
    thread = run_consumer(config, handler, metrics=metrics)
    name = config.name
    wait_for(lambda: thread.sample("outbox_consumer_dead_letter_failures_total", consumer=name,
                                   topic=sdk_topic) >= 5 and thread.consumer.totals.applied >= 3,
             message="the letter was not retried while the other partition flowed")
    assert thread.sample("outbox_consumer_dead_letter_blocked_partitions", consumer=name) == 1
    thread.stop()
    assert calls[(0, 0)] == 1 and all(calls[(1, o)] == 1 for o in range(3))
    assert thread.sample("outbox_consumer_database_errors_total", consumer=name) == 0


class _Unprintable(PermanentError):
    def __str__(self) -> str:
        raise AttributeError("no message")


@pytest.mark.parametrize("error", [
    PermanentError("bad payload: " + b'{"name": "caf\xe9"}'.decode("utf-8", "surrogateescape")),
    _Unprintable(),
])
def test_a_handler_error_that_is_no_utf8_text_is_dead_lettered_and_the_partition_moves_on(
        sdk_db, broker, sdk_topic, run_consumer, error: PermanentError):
    """A handler's error built from undecodable bytes (lone surrogates) could not be encoded
    into the dead letter's header, and one whose __str__ raises could not be formatted:
    run() raised UnicodeEncodeError / AttributeError at that record after every restart, the
    records behind it never applied (an audit with hostile records)."""
    produce_raw(broker.bootstrap, sdk_topic, [(b"bad", b'{"name": "caf\xe9"}', _headers()),
                                              (b"good", b'{"n": 1}', _headers())])
    applied: list[bytes] = []

    def handler(conn: Any, message: InboxMessage) -> None:
        if message.key == b"bad":
            raise error
        applied.append(message.key or b"")

    thread = run_consumer(make_config(sdk_db, broker, sdk_topic), handler)
    wait_settled(thread, 2)
    [letter] = read_all(broker.bootstrap, f"{sdk_topic}.dlq", expected=1, timeout_s=20)
    thread.stop()
    assert applied == [b"good"] and thread.error is None
    shown = letter.headers["dlq_error"].decode()
    assert shown in ('PermanentError: bad payload: {"name": "caf\\udce9"}',
                     "_Unprintable: <its message could not be formatted: AttributeError>"), shown


def test_an_sdk_error_subclass_without_a_docstring_raised_bare_is_itself() -> None:
    """class NotFound(PermanentError): pass; raise NotFound() raised IndexError (the message
    came from the docstring's first line, and there was none)."""
    class NotFound(PermanentError):
        pass

    assert str(NotFound()) == "NotFound" and str(NotFound("gone")) == "gone"
    assert str(PermanentError()).startswith("Raised by a handler")
