"""Plain data of the SDK: event ids, hashes, retry arithmetic, messages, configuration."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from consumer_sdk import ConfigError, InboxConfig, RetryPolicy
from consumer_sdk.config import REQUIRED_CONSUMER
from consumer_sdk.dead_letters import dead_letter_headers, dead_letter_topic
from consumer_sdk.model import (
    DeadLetter,
    InvalidEventId,
    parse_event_id,
    payload_sha256,
    to_message,
)
from consumer_sdk.offsets import OffsetBook
from consumer_sdk.retention import RetentionFinding, retention_safe, topic_retention_s
from consumer_sdk.testing import make_record


def test_event_id_parsing():
    event_id = uuid.uuid4()
    assert parse_event_id(make_record(event_id=event_id)) == event_id
    for record in (make_record(omit_event_id=True), make_record(event_id="nope"),
                   make_record(headers={"event_id": b"\xff\xfe"}, omit_event_id=True)):
        with pytest.raises(InvalidEventId):
            parse_event_id(record)


def test_message_helpers():
    record = make_record(value={"a": 1}, key="k1", headers={"traceparent": "tp", "empty": None})
    message = to_message(record)
    assert message.json() == {"a": 1} and message.key_text == "k1"
    assert message.header("traceparent") == "tp" and message.header("empty") is None
    assert to_message(make_record(value=None)).json() is None


def test_payload_hash_distinguishes_tombstones_from_empty_bodies():
    assert payload_sha256(None) is None
    assert payload_sha256(b"") == hashlib.sha256(b"").digest()


def test_retry_policy_backoff_and_limits():
    policy = RetryPolicy(max_attempts=5, backoff_initial_s=0.5, backoff_max_s=3.0)
    assert [policy.delay_s(a) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.allows(5) and not policy.allows(6)
    assert RetryPolicy(max_attempts=None).allows(10**9)
    assert RetryPolicy(backoff_initial_s=1, backoff_max_s=1e9).delay_s(10**6) == 1e9  # no overflow
    for bad in ({"max_attempts": 0}, {"backoff_initial_s": 2, "backoff_max_s": 1},
                {"backoff_multiplier": 0.5}, {"then": "skip"}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


def _config(**overrides):
    values = {"name": "svc", "dsn": "postgresql://x", "bootstrap_servers": "k:9092", "topics": ["t"]}
    values.update(overrides)
    return InboxConfig(**values)


def test_config_forces_manual_offsets_and_defaults_to_the_name_as_group():
    config = _config(kafka_properties={"enable.auto.commit": False, "session.timeout.ms": 6000,
                                       "sasl.password": "s"})
    kafka = config.consumer_kafka()
    assert {k: kafka[k] for k in REQUIRED_CONSUMER} == REQUIRED_CONSUMER
    assert kafka["group.id"] == "svc" and kafka["session.timeout.ms"] == 6000
    assert kafka["auto.offset.reset"] == "earliest"
    assert config.shared_kafka() == {"sasl.password": "s", "bootstrap.servers": "k:9092"}
    assert _config(group_id="g").consumer_kafka()["group.id"] == "g"


@pytest.mark.parametrize("overrides", [
    {"name": "has space"}, {"topics": []}, {"topics": "t"}, {"bootstrap_servers": ""},
    {"batch_size": 0}, {"poll_timeout_s": 0}, {"on_invalid_event_id": "ignore"},
    {"inbox_retention_s": 0}, {"dead_letter_topic": "t"}, {"assignment": "manual"},
    # librdkafka's own refusals: eager and cooperative mixed, an assignor it lacks, and any
    # assignor with the consumer protocol (KIP-848: the broker assigns, group.remote.assignor)
    {"kafka_properties": {"partition.assignment.strategy": "range,cooperative-sticky"}},
    {"kafka_properties": {"partition.assignment.strategy": "sticky"}},
    {"kafka_properties": {"partition.assignment.strategy": "cooperative-sticky", "group.protocol": "consumer"}},
    # librdkafka waits for a token that never comes (an audit of the security paths)
    {"kafka_properties": {"sasl.mechanism": "OAUTHBEARER"}},
])
def test_config_validation(overrides):
    with pytest.raises(ConfigError):
        _config(**overrides)


@pytest.mark.parametrize("props", [
    {"partition.assignment.strategy": "cooperative-sticky"},
    {"partition.assignment.strategy": "range,roundrobin"},
    {"group.protocol": "consumer"},
])
def test_incremental_and_eager_rebalancing_are_taken(props):
    """cooperative-sticky (incremental rebalances: the partitions kept keep flowing) is
    supported, as the consumer protocol is (InboxConsumer's callbacks take increments)."""
    assert _config(assignment="subscribe", kafka_properties=props).consumer_kafka().items() >= props.items()


def test_oauthbearer_with_a_token_source_is_taken():
    oidc = {"sasl.oauthbearer.client.id": "c", "sasl.oauthbearer.client.secret": "s",  # librdkafka needs them
            "sasl.oauthbearer.token.endpoint.url": "https://idp.example/token"}
    for props in ({"sasl.mechanism": "OAUTHBEARER", "sasl.oauthbearer.method": "oidc", **oidc},
                  {"sasl.mechanism": "OAUTHBEARER", "oauth_cb": lambda config: ("token", 1e12)},
                  {"sasl.mechanism": "OAUTHBEARER", "enable.sasl.oauthbearer.unsecure.jwt": "true"}):
        assert _config(kafka_properties=props)


@pytest.mark.parametrize(("topic_s", "inbox_s", "safe"), [
    (3600, 7200, True), (3600, 3600, False), (3600, 60, False), (None, 1e9, False), (None, None, True),
    (3600, None, True),
])
def test_retention_comparison(topic_s, inbox_s, safe):
    assert retention_safe(topic_s, inbox_s) is safe
    assert RetentionFinding("t", topic_s, inbox_s).safe is safe


def test_topic_retention_parsing():
    assert topic_retention_s("604800000") == 604800 and topic_retention_s(-1) is None
    assert topic_retention_s(None) is None


def test_dead_letter_headers_keep_the_originals_and_say_why():
    record = make_record(value={"n": 1}, topic="orders", partition=2, offset=9,
                         headers={"traceparent": "tp", "dlq_reason": "old"})
    letter = DeadLetter(record=record, consumer="svc", reason="retries_exhausted", error="E: x",
                        error_type="E", attempts=5)
    headers = dead_letter_headers(letter)
    names = [h[0] for h in headers]
    assert names[:2] == ["traceparent", "event_id"] and names.count("dlq_reason") == 1
    found = dict(headers)
    assert found["dlq_reason"] == b"retries_exhausted" and found["dlq_attempts"] == b"5"
    assert found["dlq_source_partition"] == b"2" and found["dlq_source_offset"] == b"9"
    assert dead_letter_topic("{topic}.dlq", "orders") == "orders.dlq"
    assert dead_letter_topic("all-dead", "orders") == "all-dead"


def test_offset_book_commits_only_applied_positions_and_forgets_revoked_ones():
    book = OffsetBook()
    assert book.settle([make_record(topic="t", partition=0, offset=4), make_record(topic="t", partition=1, offset=0),
                        make_record(topic="t", partition=0, offset=5)]) == {("t", 0), ("t", 1)}
    assert book.due() == {("t", 0): 6, ("t", 1): 1}
    book.confirm(("t", 0), 6)
    assert book.due() == {("t", 1): 1} and book.due({("t", 0)}) == {}
    assert book.lag(("t", 0), 10) == 4 and book.lag(("t", 9), 3) == 3
    book.forget([("t", 1)])
    assert book.due() == {}
