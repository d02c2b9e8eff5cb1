"""Bad arguments to write_event / write_events are refused with InvalidEvent before any SQL,
so the caller's transaction stays usable and nothing is written; and no id comes back for
an event that was not written.

The first part needs no database (a recording connection shows nothing was sent); the
second runs on a real PostgreSQL.  Both live here because a second module of this
basename under tests/unit/sdk would collide with this one (the tests have no __init__.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import psycopg
import pytest

from consumer_sdk import (
    InvalidEvent,
    OutboxEvent,
    write_event,
    write_event_async,
    write_events,
    write_events_async,
)
from consumer_sdk.outbox import prepare, valid_traceparent
from tests.fixtures.sdk_fakes import RecordingConnection

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SECRET = "s3cr3t-value"


class AsyncLikeConnection(RecordingConnection):
    """An execute that is a coroutine function, as psycopg.AsyncConnection's is."""

    async def execute(self, sql: str, params: Any = None) -> None:  # type: ignore[override]
        self.statements.append((sql, params))


def _refused(match: str | None = None, **kwargs: Any) -> InvalidEvent:
    conn = RecordingConnection()
    args: dict[str, Any] = {"topic": "orders", "key": "k", "payload": {}}
    args.update(kwargs)
    with pytest.raises(InvalidEvent, match=match) as caught:
        write_event(conn, **args)  # type: ignore[arg-type]
    assert conn.statements == []
    return caught.value


# -- 1: a connection that is not a sync psycopg.Connection --------------------------------


def test_an_async_like_connection_is_refused_not_given_an_id():
    conn = AsyncLikeConnection()
    with pytest.raises(TypeError, match="write_event_async") as caught:
        write_event(conn, topic="orders", key="k", payload={})  # type: ignore[arg-type]
    assert isinstance(caught.value, InvalidEvent)
    assert conn.statements == []


def test_a_none_connection_is_refused_with_the_sdk_error():
    with pytest.raises(TypeError, match="conn must be a sync psycopg.Connection") as caught:
        write_events(None, [OutboxEvent(topic="orders", key="k", payload={})])  # type: ignore[arg-type]
    assert isinstance(caught.value, InvalidEvent)


def test_an_execute_returning_an_awaitable_is_refused():
    class Sneaky(RecordingConnection):
        def execute(self, sql: str, params: Any = None) -> Any:
            async def never_run() -> None:
                self.statements.append((sql, params))
            return never_run()

    conn = Sneaky()
    with pytest.raises(TypeError):
        write_event(conn, topic="orders", key="k", payload={})  # type: ignore[arg-type]
    assert conn.statements == []


def test_events_that_are_not_a_list_of_events_are_refused():
    conn = RecordingConnection()
    for events in (None, OutboxEvent(topic="orders", key="k", payload={}), [{"topic": "orders"}]):
        with pytest.raises(InvalidEvent, match="OutboxEvent"):
            write_events(conn, events)  # type: ignore[arg-type]
    assert conn.statements == []


# -- 2: fullmatch, not re.match with $ ------------------------------------------------------


def test_a_topic_with_a_trailing_newline_is_refused():
    _refused(match="topic", topic="orders\n")


def test_a_traceparent_with_a_trailing_newline_is_not_valid_and_is_dropped():
    assert not valid_traceparent(TRACEPARENT + "\n")
    [headers] = prepare([OutboxEvent(topic="t", key=None, payload={}, traceparent=TRACEPARENT + "\n",
                                     tracestate="a=b")]).params["headers"]
    assert json.loads(headers) == {}


# -- 3: what the database would refuse, aborting the caller's transaction ----------------------


@pytest.mark.parametrize("event_id", ["not-a-uuid", 12345, "", b"0" * 16, 1.5,
                                      "96122457-773d-4a4a-8a8a-0123456789ab\n",
                                      " 96122457773d4a4a8a8a0123456789a"])
def test_an_event_id_that_is_not_a_uuid_is_refused(event_id):
    _refused(match="event_id", event_id=event_id)


@pytest.mark.parametrize("kwargs", [
    {"payload": {"note": "a\x00b"}},
    {"payload": ["nested", {"deep": "\x00"}]},
    {"payload": {"k\x00": 1}},
    {"headers": {"h": "v\x00" + SECRET}},
    {"headers": {"h\x00": "v"}},
])
def test_nul_characters_are_refused(kwargs):
    error = _refused(match="NUL", **kwargs)
    assert SECRET not in str(error)


def test_an_escaped_backslash_u0000_is_not_a_nul():
    [text] = prepare([OutboxEvent(topic="t", key=None, payload={"p": "\\u0000 " + "\ud7ff"})]).params["payloads"]
    assert json.loads(text) == {"p": "\\u0000 \ud7ff"}
    with pytest.raises(InvalidEvent, match="NUL"):  # and a real NUL next to an escaped backslash is one
        prepare([OutboxEvent(topic="t", key=None, payload={"p": "\\\x00"})])


@pytest.mark.parametrize("kwargs", [
    {"key": "k\ud800"},
    {"payload": {"note": "\udcff" + SECRET}},
    {"payload": {"\ud800": 1}},
    {"headers": {"h": "\ud800" + SECRET}},
])
def test_lone_surrogates_are_refused_as_not_utf8(kwargs):
    error = _refused(match="not valid UTF-8 text", **kwargs)
    assert SECRET not in str(error)


@pytest.mark.parametrize(("kwargs", "kept"), [
    ({"traceparent": TRACEPARENT, "tracestate": "a=\x00"}, {"traceparent": TRACEPARENT}),
    ({"traceparent": TRACEPARENT, "tracestate": "a=\ud800"}, {"traceparent": TRACEPARENT}),
    ({"headers": {"traceparent": TRACEPARENT, "tracestate": "a=\x00", "h": "v"}},
     {"traceparent": TRACEPARENT, "h": "v"}),
    ({"traceparent": TRACEPARENT, "tracestate": "a=" + "b" * 511}, {"traceparent": TRACEPARENT}),
    ({"tracestate": "a=\x00"}, {}),
    ({"headers": {"tracestate": "a=b", "h": "v"}}, {"h": "v"}),  # no traceparent: means nothing
])
def test_a_tracestate_that_cannot_be_kept_is_dropped_not_refused(kwargs, kept):
    """Trace context never fails the business transaction: a tracestate with a NUL or a lone
    surrogate was refused (InvalidEvent), where one too long was dropped and a job's was."""
    [headers] = prepare([OutboxEvent(topic="t", key=None, payload={}, **kwargs)]).params["headers"]
    assert json.loads(headers) == kept


@pytest.mark.parametrize("kwargs", [
    {"traceparent": 123},
    {"traceparent": TRACEPARENT.encode()},
    {"traceparent": TRACEPARENT, "tracestate": 123},
    {"tracestate": ["a=b"]},
])
def test_trace_context_that_is_not_a_str_is_refused(kwargs):
    _refused(match="trace(parent|state) must be None or a str", **kwargs)


@pytest.mark.parametrize("headers", [[("h", "v")], "h=v", (("h", "v"),)])
def test_headers_that_are_not_a_mapping_of_str_are_refused(headers):
    _refused(match="header", headers=headers)


def test_a_deeply_nested_payload_is_refused_not_a_recursion_error():
    payload: Any = "leaf"
    for _ in range(100_000):
        payload = [payload]
    _refused(match="nested too deeply", payload=payload)


def test_the_same_event_id_twice_in_one_batch_is_refused():
    conn = RecordingConnection()
    same = uuid.uuid4()
    events = [OutboxEvent(topic="t", key="a", payload={}, event_id=same),
              OutboxEvent(topic="t", key="b", payload={}, event_id=str(same).upper())]
    with pytest.raises(InvalidEvent, match="event_id"):
        write_events(conn, events)
    assert conn.statements == []


# -- 4: a traceparent in headers ------------------------------------------------------------


def test_a_traceparent_header_is_validated_like_the_argument():
    [headers] = prepare([OutboxEvent(topic="t", key=None, payload={},
                                     headers={"traceparent": "garbage", "tracestate": "a=b", "h": "v"}
                                     )]).params["headers"]
    assert json.loads(headers) == {"h": "v"}
    [headers] = prepare([OutboxEvent(topic="t", key=None, payload={},
                                     headers={"traceparent": TRACEPARENT + "\n"})]).params["headers"]
    assert json.loads(headers) == {}


def test_a_traceparent_given_twice_with_different_values_is_refused():
    _refused(match="traceparent", headers={"traceparent": TRACEPARENT}, traceparent=OTHER_TRACEPARENT)
    _refused(match="tracestate", headers={"tracestate": "a=1"}, traceparent=TRACEPARENT, tracestate="a=2")
    [headers] = prepare([OutboxEvent(topic="t", key=None, payload={}, headers={"traceparent": TRACEPARENT},
                                     traceparent=TRACEPARENT, tracestate="a=1")]).params["headers"]
    assert json.loads(headers) == {"traceparent": TRACEPARENT, "tracestate": "a=1"}


# -- 5: the id returned is the canonical one stored ----------------------------------------


def test_an_event_id_given_as_text_returns_the_canonical_uuid():
    conn = RecordingConnection()
    given = "{96122457-773D-4A4A-8A8A-0123456789AB}"
    returned = write_event(conn, topic="t", key=None, payload={}, event_id=given)
    assert isinstance(returned, uuid.UUID) and returned == uuid.UUID("96122457-773d-4a4a-8a8a-0123456789ab")
    [(_, params)] = conn.statements
    assert params["event_ids"] == [returned]


# -- 6: keys colliding once stringified -------------------------------------------------------


@pytest.mark.parametrize("payload", [{1: "a", "1": "b"}, {"x": [{True: 1, "true": 2}]},
                                     {None: 1, "null": 2}, {1.5: 1, "1.5": 2}])
def test_payload_keys_colliding_as_json_strings_are_refused(payload):
    _refused(match="collide", payload=payload)
    [text] = prepare([OutboxEvent(topic="t", key=None, payload={1: "a", 2: "b"})]).params["payloads"]
    assert json.loads(text) == {"1": "a", "2": "b"}  # json.dumps's key conversion still applies


# -- on a real PostgreSQL ------------------------------------------------------------------

def _rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT event_id, topic, key, payload, headers FROM outbox ORDER BY id").fetchall()


def _refused_then_usable(dsn: str, **kwargs: Any) -> InvalidEvent:
    """The bad write raises InvalidEvent; the same transaction then writes a good event and
    commits: only the good one is stored."""
    args: dict[str, Any] = {"topic": "orders", "key": "k", "payload": {"n": 1}}
    args.update(kwargs)
    with psycopg.connect(dsn) as conn:
        with pytest.raises(InvalidEvent) as caught:
            write_event(conn, **args)
        assert conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR
        good = write_event(conn, topic="orders", key="good", payload={"ok": True})
        conn.commit()
    assert [(r[0], r[2]) for r in _rows(dsn)] == [(good, "good")]
    return caught.value


def test_an_async_connection_given_to_the_sync_api_is_refused_not_lost(sdk_db):
    """Before the fix: an id came back and nothing was written (the execute coroutine was
    never awaited)."""
    async def scenario() -> tuple[object, int]:
        async with await psycopg.AsyncConnection.connect(sdk_db) as conn:
            try:
                outcome: object = write_event(conn, topic="orders", key="k", payload={"n": 1})  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - the outcome is checked below
                outcome = exc
            try:
                write_events(conn, [OutboxEvent(topic="orders", key="k", payload={})])  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001, S110 - the first call's outcome is what is checked
                pass
            await conn.commit()
            cur = await conn.execute("SELECT count(*) FROM outbox")
            row = await cur.fetchone()
            assert row is not None
            return outcome, int(row[0])

    outcome, written = asyncio.run(scenario())
    assert written == 0
    assert isinstance(outcome, TypeError) and isinstance(outcome, InvalidEvent), \
        f"returned {outcome!r} while {written} rows were written"
    assert "write_event_async" in str(outcome)


def test_a_sync_connection_given_to_the_async_api_is_refused_before_writing(sdk_db):
    """Before the fix: the row was inserted, then the await of the cursor raised a bare TypeError."""
    async def scenario() -> None:
        with psycopg.connect(sdk_db) as conn:
            with pytest.raises(InvalidEvent, match="consumer_sdk.write_event"):
                await write_event_async(conn, topic="orders", key="k", payload={})  # type: ignore[arg-type]
            with pytest.raises(InvalidEvent):
                await write_events_async(conn, [OutboxEvent(topic="orders", key="k", payload={})])  # type: ignore[arg-type]
            conn.commit()

    asyncio.run(scenario())
    assert _rows(sdk_db) == []


def test_a_topic_with_a_trailing_newline_is_refused_before_the_check_constraint(sdk_db):
    _refused_then_usable(sdk_db, topic="orders\n")


def test_a_traceparent_with_a_trailing_newline_is_not_stored(sdk_db):
    with psycopg.connect(sdk_db) as conn:
        write_event(conn, topic="orders", key="k", payload={}, traceparent=TRACEPARENT + "\n", tracestate="a=b")
        write_event(conn, topic="orders", key="k", payload={}, headers={"traceparent": "garbage"})
        conn.commit()
    assert [r[4] for r in _rows(sdk_db)] == [{}, {}]


@pytest.mark.parametrize("kwargs", [
    {"event_id": "not-a-uuid"},
    {"event_id": 12345},
    {"payload": {"note": "a\x00b"}},
    {"headers": {"h": "v\x00"}},
    {"key": "k\ud800"},
    {"payload": {"note": "\ud800"}},
    {"headers": {"h": "\udfff"}},
    {"traceparent": 7},
    {"traceparent": TRACEPARENT, "tracestate": 7},
    {"headers": [("h", "v")]},
])
def test_bad_arguments_leave_the_transaction_usable(sdk_db, kwargs):
    _refused_then_usable(sdk_db, **kwargs)


def test_a_deeply_nested_payload_is_refused(sdk_db):
    payload: Any = {}
    for _ in range(100_000):
        payload = {"d": payload}
    _refused_then_usable(sdk_db, payload=payload)


def test_the_same_event_id_twice_in_one_batch_is_refused_before_the_database(sdk_db):
    same = uuid.uuid4()
    with psycopg.connect(sdk_db) as conn:
        with pytest.raises(InvalidEvent, match="event_id"):
            write_events(conn, [OutboxEvent(topic="orders", key="a", payload={}, event_id=same),
                                OutboxEvent(topic="orders", key="b", payload={}, event_id=same)])
        assert conn.execute("SELECT 1").fetchone() == (1,)
        conn.commit()
    assert _rows(sdk_db) == []


def test_a_traceparent_in_headers_conflicting_with_the_argument_is_refused(sdk_db):
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    _refused_then_usable(sdk_db, headers={"traceparent": other}, traceparent=TRACEPARENT)


def test_an_event_id_in_braces_and_upper_case_returns_what_is_stored(sdk_db):
    given = "{96122457-773D-4A4A-8A8A-0123456789AB}"
    with psycopg.connect(sdk_db) as conn:
        returned = write_event(conn, topic="orders", key="k", payload={}, event_id=given)
        conn.commit()
    [(stored, *_)] = _rows(sdk_db)
    assert isinstance(returned, uuid.UUID) and returned == stored
    assert str(returned) == "96122457-773d-4a4a-8a8a-0123456789ab"


def test_payload_keys_colliding_once_stringified_are_refused_not_collapsed(sdk_db):
    _refused_then_usable(sdk_db, payload={1: "a", "1": "b"})
