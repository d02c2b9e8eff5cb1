"""Handler failures, malformed messages and reused event ids, with a real database and broker."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from consumer_sdk import ConsumerStopped, InboxMessage, PermanentError, RetryPolicy
from tests.fixtures.broker import create_topic, read_all
from tests.integration.sdk._support import (
    effect_counts,
    make_config,
    produce_raw,
    publish_all,
    record_effect,
    wait_settled,
    write_numbered,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("batch_size", [1, 32], ids=["single", "batched"])
def test_failing_fraction_is_retried_dead_lettered_and_the_rest_applied_once(
        sdk_db, broker, sdk_topic, run_consumer, batch_size):
    n = 200
    ids = write_numbered(sdk_db, sdk_topic, n, headers={"tenant": "acme", "traceparent": TRACEPARENT})
    publish_all(sdk_db, broker.bootstrap)
    always = {i for i in range(n) if i % 10 == 3}
    transient = {i for i in range(n) if i % 10 == 7}
    permanent = {i for i in range(n) if i % 25 == 0}
    attempts: Counter[int] = Counter()
    sleeps: list[float] = []

    def handler(conn: psycopg.Connection, message: InboxMessage) -> None:
        i = message.json()["n"]
        attempts[i] += 1
        record_effect(conn, message)  # written first: a failure must roll it back
        if i in permanent:
            raise PermanentError(f"event {i} can never work")
        if i in always or (i in transient and attempts[i] <= 2):
            raise RuntimeError(f"boom {i}")

    retry = RetryPolicy(max_attempts=3, backoff_initial_s=0.1, backoff_max_s=1.0)
    config = make_config(sdk_db, broker, sdk_topic, batch_size=batch_size, retry=retry)
    thread = run_consumer(config, handler, sleep=sleeps.append)
    wait_settled(thread, n)
    thread.stop()

    failed = always | permanent
    effects = effect_counts(sdk_db)
    assert set(effects.values()) == {1}
    assert {ids[i] for i in range(n) if i not in failed} == set(effects)
    assert all(attempts[i] == 3 for i in always)
    assert all(attempts[i] == 1 for i in permanent)
    assert all(attempts[i] == 3 for i in transient)
    assert sorted(set(sleeps)) == [0.1, 0.2]  # exponential back-off between the attempts

    letters = read_all(broker.bootstrap, f"{sdk_topic}.dlq", expected=len(failed), timeout_s=30, extra_wait_s=0.5)
    assert len(letters) == len(failed)
    by_n = {json.loads(r.value)["n"]: r for r in letters}
    assert set(by_n) == failed
    for i, letter in by_n.items():
        assert letter.headers["event_id"].decode() == ids[i]
        assert letter.headers["tenant"] == b"acme" and letter.headers["traceparent"] == TRACEPARENT.encode()
        assert letter.headers["dlq_source_topic"] == sdk_topic.encode()
        assert letter.headers["dlq_consumer"] == config.name.encode()
        if i in permanent:
            assert letter.headers["dlq_reason"] == b"permanent_error"
            assert letter.headers["dlq_attempts"] == b"1"
            assert letter.headers["dlq_error_type"] == b"PermanentError"
        else:
            assert letter.headers["dlq_reason"] == b"retries_exhausted"
            assert letter.headers["dlq_attempts"] == b"3"
            assert letter.headers["dlq_error"] == f"RuntimeError: boom {i}".encode()

    labels = {"consumer": config.name, "topic": sdk_topic}
    assert thread.sample("outbox_consumer_processed_total", **labels) == n - len(failed)
    assert thread.sample("outbox_consumer_handler_errors_total", **labels) == (
        3 * len(always) + len(permanent) + 2 * len(transient))
    assert thread.sample("outbox_consumer_dead_lettered_total", reason="retries_exhausted", **labels) == len(always)
    assert thread.sample("outbox_consumer_dead_lettered_total", reason="permanent_error", **labels) == len(permanent)


def test_stop_policy_stops_before_the_message_and_a_restart_resumes_there(
        sdk_db, broker, topic_name, run_consumer):
    topic = topic_name("stop")
    create_topic(broker.bootstrap, topic, partitions=1)
    create_topic(broker.bootstrap, f"{topic}.dlq", partitions=1)  # Apache Kafka does not auto-create it
    ids = write_numbered(sdk_db, topic, 20)
    publish_all(sdk_db, broker.bootstrap)
    broken = threading.Event()
    broken.set()
    calls: Counter[int] = Counter()

    def handler(conn: psycopg.Connection, message: InboxMessage) -> None:
        i = message.json()["n"]
        calls[i] += 1
        if i == 5 and broken.is_set():
            raise RuntimeError("dependency down")
        record_effect(conn, message)

    config = make_config(sdk_db, broker, topic, retry=RetryPolicy(max_attempts=2, then="stop"))
    first = run_consumer(config, handler, sleep=lambda _s: None)
    first.thread.join(30)
    assert isinstance(first.error, ConsumerStopped)
    assert (first.error.reason, first.error.offset) == ("retries_exhausted", 5)
    assert set(effect_counts(sdk_db)) == set(ids[:5])  # everything before it, nothing after

    broken.clear()
    second = run_consumer(config, handler)
    wait_settled(second, 15)  # restarts at the failed message's offset
    second.stop()
    assert set(effect_counts(sdk_db)) == set(ids) and set(effect_counts(sdk_db).values()) == {1}
    assert calls[5] == 3 and calls[4] == 1 and calls[6] == 1


@pytest.mark.parametrize("policy", ["dead_letter", "skip"])
def test_messages_without_a_valid_event_id_follow_the_policy_and_never_crash(
        sdk_db, broker, sdk_topic, run_consumer, policy):
    good = str(uuid.uuid4())
    produce_raw(broker.bootstrap, sdk_topic, [
        (b"k", b'{"n": 1}', []),
        (b"k", b'{"n": 2}', [("event_id", b"not-a-uuid")]),
        (b"k", b'{"n": 3}', [("event_id", good.encode())]),
    ])
    applied: list[int] = []

    def handler(conn: psycopg.Connection, message: InboxMessage) -> None:
        applied.append(message.json()["n"])

    config = make_config(sdk_db, broker, sdk_topic, on_invalid_event_id=policy)
    thread = run_consumer(config, handler)
    wait_settled(thread, 3)
    thread.stop()
    assert applied == [3]
    labels = {"consumer": config.name, "topic": sdk_topic}
    assert thread.sample("outbox_consumer_invalid_messages_total", **labels) == 2
    if policy == "dead_letter":
        letters = read_all(broker.bootstrap, f"{sdk_topic}.dlq", expected=2, timeout_s=20)
        assert sorted(json.loads(r.value)["n"] for r in letters) == [1, 2]
        assert {r.headers["dlq_reason"] for r in letters} == {b"invalid_event_id"}
        assert letters[0].headers["dlq_attempts"] == b"0"
    else:
        assert thread.sample("outbox_consumer_skipped_total", reason="invalid_event_id", **labels) == 2


def test_a_reused_event_id_with_another_body_is_reported_not_dropped(sdk_db, broker, sdk_topic, run_consumer):
    event_id = str(uuid.uuid4()).encode()
    produce_raw(broker.bootstrap, sdk_topic, [
        (b"k", b'{"n": 1}', [("event_id", event_id)]),
        (b"k", b'{"n": 1}', [("event_id", event_id)]),  # a genuine redelivery
        (b"k", b'{"n": 2}', [("event_id", event_id)]),  # same id, other body
    ])
    applied: list[Any] = []
    config = make_config(sdk_db, broker, sdk_topic)
    with capture_logs() as logs:
        thread = run_consumer(config, lambda conn, message: applied.append(message.json()))
        wait_settled(thread, 3)
        thread.stop()
    assert applied == [{"n": 1}]
    labels = {"consumer": config.name, "topic": sdk_topic}
    assert thread.sample("outbox_consumer_duplicates_dropped_total", **labels) == 1
    assert thread.sample("outbox_consumer_payload_mismatches_total", **labels) == 1
    assert thread.sample("outbox_consumer_dead_lettered_total", reason="payload_mismatch", **labels) == 1
    mismatch = [e for e in logs if e["event"] == "payload_mismatch"]
    assert len(mismatch) == 1 and mismatch[0]["log_level"] == "error" and mismatch[0]["offset"] == 2
    [letter] = read_all(broker.bootstrap, f"{sdk_topic}.dlq", expected=1, timeout_s=20)
    assert letter.value == b'{"n": 2}' and letter.headers["dlq_reason"] == b"payload_mismatch"
