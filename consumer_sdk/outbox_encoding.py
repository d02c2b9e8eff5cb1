"""Events checked and encoded into the outbox insert's parameters, before any I/O.

:func:`prepare` is what the sync writer (:mod:`consumer_sdk.outbox`), its asyncio twin
(:mod:`consumer_sdk.aio`) and the jobs' events (:mod:`consumer_sdk.jobs._plan`) share, so
that one set of rules decides what is stored.  Bad arguments are refused here, before
anything reaches the database, which keeps the caller's transaction usable:
:class:`InvalidEvent` names the argument and what is allowed, without echoing payload or
header values.  The payload and header rules are in the module docstring of
:mod:`consumer_sdk.outbox`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from consumer_sdk.errors import InvalidEvent
from consumer_sdk.model import EVENT_ID_HEADER, valid_topic_name
from consumer_sdk.replays import REPLAY_HEADER
from consumer_sdk.trace_context import (
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    kept_tracestate,
    valid_traceparent,
)
from outbox_core.text import has_colliding_keys, refuse_unstorable, uuid_from_text

# The logger's name is the one these lines had before they moved out of consumer_sdk.outbox.
_log = structlog.get_logger("consumer_sdk.outbox")


@dataclass(frozen=True, kw_only=True)
class OutboxEvent:
    """One event to write.  ``event_id`` is generated (:func:`new_event_id`) when not given."""

    topic: str
    key: str | None
    payload: Any
    headers: Mapping[str, str | None] | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    event_id: uuid.UUID | str | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """The statement parameters of a batch of events, and their ids in order."""

    event_ids: list[uuid.UUID]
    params: dict[str, list[Any]]


_TIME_MASK = (1 << 48) - 1
_RAND_B_MASK = (1 << 62) - 1
_VERSION_7 = 0x7 << 76
_VARIANT_RFC = 0b10 << 62


def new_event_id() -> uuid.UUID:
    """A fresh event id: a version 7 UUID (RFC 9562), the Unix time in milliseconds in its
    first 48 bits and 74 random bits after the version and variant, as PostgreSQL 18's
    ``uuidv7()`` and the outbox's column default make them.  Ids made later sort later
    (within one millisecond, in any order); like ``created_at``, an id tells when it was
    made."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits: 12 for rand_a, 62 for rand_b
    return uuid.UUID(int=((millis & _TIME_MASK) << 80) | _VERSION_7 | ((rand >> 68) << 64)
                     | _VARIANT_RFC | (rand & _RAND_B_MASK))


def _storable(name: str, value: str) -> None:
    refuse_unstorable(name, value, InvalidEvent)


def _json_storable(name: str, encoded: str) -> str:
    return refuse_unstorable(name, encoded, InvalidEvent, json=True)


def encode_payload(payload: Any) -> tuple[str | None, bytes | None]:
    """``(json_text, raw_bytes)``: at most one is set; both None is a tombstone.

    JSON payloads follow json.dumps (dict keys may be str, int, float, bool or None,
    written as strings), except that keys colliding once stringified (``{1: "a", "1": "b"}``)
    are refused rather than collapsed by jsonb, as are NaN/Infinity, NUL characters and lone
    surrogates in strings, and nesting too deep to encode."""
    if payload is None:
        return None, None
    if isinstance(payload, bytes | bytearray | memoryview):
        return None, bytes(payload)
    try:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"the payload is neither bytes nor JSON-encodable: {exc}") from None
    except RecursionError:
        raise InvalidEvent("the payload is nested too deeply to encode as JSON") from None
    _json_storable("the payload", text)
    if has_colliding_keys(payload):
        raise InvalidEvent("the payload has a dict whose keys collide once converted to JSON strings "
                           "(like 1 and '1'): keys must be distinct as strings")
    return text, None

def _trace_argument(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidEvent(f"{name} must be None or a str, not {type(value).__name__}")
    return value


def _one_trace_value(name: str, argument: str | None, header: str | None) -> str | None:
    """The argument or the header of the same name; refused when both are given and differ."""
    if argument is not None and header is not None and argument != header:
        raise InvalidEvent(f"{name} is given both as an argument and in headers, with different "
                           f"values: give it once")
    return argument if argument is not None else header


def encode_headers(event: OutboxEvent) -> str:
    """The headers as a JSON object of strings, with the trace context when it is valid.

    ``headers`` must be a mapping of non-empty str names to str (or None) values, without
    the two the relay sets (``event_id``, ``replay_id``).  A
    ``traceparent``/``tracestate`` given in ``headers`` is treated like the argument of the
    same name (giving both with different values is refused).  Trace context never fails
    the business transaction: an invalid traceparent is dropped, with its tracestate, and
    logged; a tracestate without a traceparent, too long or unstorable is dropped."""
    if event.headers is not None and not isinstance(event.headers, Mapping):
        raise InvalidEvent("headers must be None or a mapping of str names to str (or None) values, "
                           f"not {type(event.headers).__name__}")
    traceparent = _trace_argument("traceparent", event.traceparent)
    tracestate = _trace_argument("tracestate", event.tracestate)
    headers: dict[str, str | None] = {}
    for name, value in (event.headers or {}).items():
        if not isinstance(name, str) or not name:
            raise InvalidEvent(f"header names must be non-empty strings, got {type(name).__name__}")
        _storable("a header name", name)
        if name == EVENT_ID_HEADER:
            raise InvalidEvent("the event_id header is reserved: pass event_id= instead")
        if name == REPLAY_HEADER:  # a consumer applying that replay would apply the event again
            raise InvalidEvent("the replay_id header is reserved: the relay sets it on the events "
                               "it republishes (outbox-relay replay)")
        if value is not None and not isinstance(value, str):
            raise InvalidEvent(f"header {name!r} must be a string or None, not {type(value).__name__}")
        if value is not None and name not in (TRACEPARENT_HEADER, TRACESTATE_HEADER):
            _storable(f"header {name!r}", value)  # the trace context's are kept or dropped below
        headers[name] = value
    if event.headers is not None:
        traceparent = _one_trace_value(TRACEPARENT_HEADER, traceparent, headers.get(TRACEPARENT_HEADER))
        tracestate = _one_trace_value(TRACESTATE_HEADER, tracestate, headers.get(TRACESTATE_HEADER))
    # The trace headers are the trace context's: kept only beside a valid traceparent (W3C:
    # a tracestate without one means nothing), whether given as arguments or in headers.
    headers.pop(TRACEPARENT_HEADER, None)
    headers.pop(TRACESTATE_HEADER, None)
    if traceparent is not None:
        if valid_traceparent(traceparent):
            headers[TRACEPARENT_HEADER] = traceparent
            tracestate = kept_tracestate(tracestate)
            if tracestate:
                headers[TRACESTATE_HEADER] = tracestate
        else:  # a broken trace header must not fail the business transaction
            _log.warning("trace_context_invalid", traceparent=traceparent[:100])
    return _json_storable("headers", json.dumps(headers, separators=(",", ":"), ensure_ascii=False))


def _check(event: OutboxEvent) -> None:
    if not valid_topic_name(event.topic):
        shown = repr(event.topic) if isinstance(event.topic, str) else type(event.topic).__name__
        raise InvalidEvent(f"invalid Kafka topic name {shown[:120]}: 1-249 of [A-Za-z0-9._-], "
                           "not '.' or '..'")
    if event.key is not None:
        if not isinstance(event.key, str):
            raise InvalidEvent("the key must be a str without NUL characters, or None, "
                               f"not {type(event.key).__name__}")
        _storable("the key", event.key)


def _event_id(value: Any) -> uuid.UUID:
    """The event id to store: given (a ``uuid.UUID`` or its text, canonicalized) or new."""
    if value is None:
        return new_event_id()
    if isinstance(value, uuid.UUID):
        return value
    parsed = uuid_from_text(value)
    if parsed is not None:
        return parsed
    raise InvalidEvent("event_id must be None, a uuid.UUID or a UUID's text (32 hex digits, "
                       f"optionally hyphenated or in braces), not this {type(value).__name__}")


def prepare(events: Iterable[OutboxEvent]) -> Prepared:
    """Validate and encode events into the ``insert_events`` parameters (no I/O).

    An event id may be given as a ``uuid.UUID`` or its text; the ``uuid.UUID`` stored is the
    one returned.  The same id twice in one batch is refused."""
    events = _event_list(events)
    ids: list[uuid.UUID] = []
    seen: set[uuid.UUID] = set()
    params: dict[str, list[Any]] = {
        "event_ids": [], "topics": [], "keys": [], "payloads": [], "payloads_bytes": [], "headers": [],
    }
    for event in events:
        if not isinstance(event, OutboxEvent):
            raise InvalidEvent(f"events must be OutboxEvent instances, not {type(event).__name__}")
        _check(event)
        event_id = _event_id(event.event_id)
        if event_id in seen:
            raise InvalidEvent(f"event_id {event_id} is given twice in one batch: event ids are unique")
        seen.add(event_id)
        text, raw = encode_payload(event.payload)
        headers = encode_headers(event)
        ids.append(event_id)
        params["event_ids"].append(event_id)
        params["topics"].append(event.topic)
        params["keys"].append(event.key)
        params["payloads"].append(text)
        params["payloads_bytes"].append(raw)
        params["headers"].append(headers)
    return Prepared(ids, params)


def _event_list(events: Any) -> Any:
    if events is None or isinstance(events, OutboxEvent | str | bytes | Mapping) or \
            not isinstance(events, Iterable):
        raise InvalidEvent("events must be a sequence of OutboxEvent, not "
                           f"{'None' if events is None else type(events).__name__}")
    return events
