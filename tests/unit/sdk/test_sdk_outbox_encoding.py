"""The producing side's validation and encoding (no database)."""

from __future__ import annotations

import json
import uuid

import pytest
from psycopg.pq import TransactionStatus

from consumer_sdk import InvalidEvent, OutboxEvent, TransactionRequired, write_events
from consumer_sdk.outbox import (
    encode_payload,
    new_event_id,
    prepare,
    require_transaction,
    valid_traceparent,
)
from tests.fixtures.sdk_fakes import RecordingConnection

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(("payload", "expected"), [
    ({"a": [1, "é"]}, ('{"a":[1,"é"]}', None)),
    ("text", ('"text"', None)),
    (0, ("0", None)),
    (b"\x00raw", (None, b"\x00raw")),
    (bytearray(b"ba"), (None, b"ba")),
    (memoryview(b"mv"), (None, b"mv")),
    (None, (None, None)),
])
def test_payload_routing(payload, expected):
    assert encode_payload(payload) == expected


@pytest.mark.parametrize("payload", [object(), float("nan"), {"k": {1, 2}}])
def test_payloads_that_are_not_json_are_refused(payload):
    with pytest.raises(InvalidEvent):
        encode_payload(payload)


def test_prepare_keeps_order_and_generates_ids():
    given = uuid.uuid4()
    prepared = prepare([OutboxEvent(topic="a", key="k", payload={"n": 1}),
                        OutboxEvent(topic="b", key=None, payload=b"x", event_id=given)])
    assert prepared.event_ids[1] == given and prepared.event_ids[0].version == 7
    assert prepared.params["topics"] == ["a", "b"] and prepared.params["keys"] == ["k", None]
    assert prepared.params["payloads"] == ['{"n":1}', None]
    assert prepared.params["payloads_bytes"] == [None, b"x"]
    assert [json.loads(h) for h in prepared.params["headers"]] == [{}, {}]


def test_generated_ids_are_version_7_with_the_time_in_milliseconds(monkeypatch):
    """RFC 9562's layout: 48 bits of Unix milliseconds, version 7, the RFC variant, and
    the rest random, so ids of later milliseconds sort after earlier ones."""
    clock = iter([1_796_000_000_123_456_789, 1_796_000_000_124_000_000])
    monkeypatch.setattr("consumer_sdk.outbox_encoding.time.time_ns", lambda: next(clock))
    first, second = new_event_id(), new_event_id()
    assert (first.version, first.variant) == (7, uuid.RFC_4122)
    assert int(first.hex[:12], 16) == 1_796_000_000_123
    assert int(second.hex[:12], 16) == 1_796_000_000_124
    assert first < second and str(first) < str(second)


def test_generated_ids_within_one_millisecond_differ_in_their_random_bits(monkeypatch):
    monkeypatch.setattr("consumer_sdk.outbox_encoding.time.time_ns", lambda: 1_796_000_000_123_000_000)
    ids = {new_event_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert {int(u.hex[:12], 16) for u in ids} == {1_796_000_000_123}
    assert {(u.version, u.variant) for u in ids} == {(7, uuid.RFC_4122)}


@pytest.mark.parametrize("event", [
    OutboxEvent(topic="bad topic", key=None, payload={}),
    OutboxEvent(topic="..", key=None, payload={}),
    OutboxEvent(topic="x" * 250, key=None, payload={}),
    OutboxEvent(topic="t", key=b"bytes", payload={}),  # type: ignore[arg-type]
    OutboxEvent(topic="t", key="nul\x00", payload={}),
    OutboxEvent(topic="t", key=None, payload={}, headers={"event_id": "x"}),
    OutboxEvent(topic="t", key=None, payload={}, headers={"n": 1}),  # type: ignore[dict-item]
    OutboxEvent(topic="t", key=None, payload={}, headers={"": "x"}),
])
def test_invalid_events_are_refused_before_any_sql(event):
    with pytest.raises(InvalidEvent):
        prepare([event])


@pytest.mark.parametrize("name", ["event_id", "replay_id"])
def test_the_headers_the_relay_sets_are_reserved(name):
    # replay_id was not: an event written with it was, at a consumer applying that replay
    # (InboxConfig.apply_replays), deduplicated under the replay's inbox key and applied again.
    with pytest.raises(InvalidEvent, match=f"the {name} header is reserved"):
        prepare([OutboxEvent(topic="t", key=None, payload={}, headers={name: "1"})])


def test_trace_context_goes_into_the_headers_when_valid():
    [headers] = prepare([OutboxEvent(topic="t", key=None, payload={}, headers={"h": "v", "n": None},
                                     traceparent=TRACEPARENT, tracestate="congo=t61")]).params["headers"]
    assert json.loads(headers) == {"h": "v", "n": None, "traceparent": TRACEPARENT, "tracestate": "congo=t61"}


@pytest.mark.parametrize("value", ["garbage", "ff-" + TRACEPARENT[3:], "00-" + "0" * 32 + TRACEPARENT[35:],
                                   TRACEPARENT.upper()])
def test_an_invalid_trace_context_is_dropped_not_fatal(value):
    assert not valid_traceparent(value)
    [headers] = prepare([OutboxEvent(topic="t", key=None, payload={}, traceparent=value,
                                     tracestate="a=b")]).params["headers"]
    assert json.loads(headers) == {}


def test_autocommit_outside_a_transaction_is_refused():
    with pytest.raises(TransactionRequired):
        require_transaction(True, TransactionStatus.IDLE)
    require_transaction(True, TransactionStatus.INTRANS)
    require_transaction(False, TransactionStatus.IDLE)  # psycopg opens one; the caller commits


def test_many_events_are_one_statement():
    conn = RecordingConnection()
    ids = write_events(conn, [OutboxEvent(topic="t", key=str(i), payload={"i": i}) for i in range(100)])  # type: ignore[arg-type]
    assert len(conn.statements) == 1 and len(ids) == 100
    sql, params = conn.statements[0]
    assert "unnest" in sql and params["event_ids"] == ids
