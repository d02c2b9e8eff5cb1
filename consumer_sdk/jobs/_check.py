"""Argument checks shared by the jobs API (pure: no I/O).

Every public entry point checks its arguments here before anything reaches the
database, and a bad one raises :class:`~consumer_sdk.jobs.errors.InvalidJob` (a
``ValueError``) naming the parameter, what is allowed and the value received.
Regular expressions are matched with ``fullmatch`` (``$`` would accept a trailing
newline).  Text stored in PostgreSQL may hold neither NUL characters nor lone
surrogates (they cannot be encoded as UTF-8).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import psycopg
import structlog

from consumer_sdk.config import check_int, check_seconds, shown
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.model import valid_topic_name
from consumer_sdk.trace_context import kept_tracestate, valid_traceparent
from outbox_core.text import refuse_unstorable, uuid_from_text

_log = structlog.get_logger("consumer_sdk.jobs")

#: Queue names (the ``jobs_queue_valid`` CHECK of 0005_jobs.sql).
QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}\Z")

#: owner_id, request_key, kind, worker ids: the runs table's length CHECKs.
MAX_ID_CHARS = 200
#: max_attempts and limits are stored as PostgreSQL ``integer``.
MAX_INT4 = 2**31 - 1
#: The longest delay or wait accepted: 100 years (PostgreSQL intervals hold far more).
MAX_DELAY_S = 100 * 365.25 * 86400.0


def text(name: str, value: Any, *, max_chars: int = MAX_ID_CHARS, min_chars: int = 1) -> str:
    """A str of ``min_chars``..``max_chars`` characters that PostgreSQL can store."""
    if not isinstance(value, str) or not min_chars <= len(value) <= max_chars:
        what = "a non-empty string" if min_chars == 1 else "a string"
        raise InvalidJob(f"{name} must be {what} of at most {max_chars} characters, got {shown(value)}")
    storable(name, value)
    return value


def storable(name: str, value: str) -> None:
    refuse_unstorable(name, value, InvalidJob)


def json_storable(what: str, encoded: str) -> str:
    return refuse_unstorable(f"the {what}", encoded, InvalidJob, json=True)


def queue(name: str, value: Any) -> str:
    if not isinstance(value, str) or not QUEUE_NAME.fullmatch(value):
        raise InvalidJob(f"{name} must be a queue name of 1-64 of [A-Za-z0-9_.:-], got {shown(value)}")
    return value


def topic(name: str, value: Any) -> str | None:
    """None, or a Kafka topic name: 1-249 of [A-Za-z0-9._-], not "." or ".."."""
    if value is None:
        return None
    if not valid_topic_name(value):
        raise InvalidJob(f"{name} must be None or a Kafka topic name of 1-249 of [A-Za-z0-9._-] "
                         f"(not '.' or '..'), got {shown(value)}")
    return value


def integer(name: str, value: Any, lo: int, hi: int = MAX_INT4) -> int:
    """An int (not a bool, not a float) within ``[lo, hi]``."""
    return check_int(name, value, lo, hi, error=InvalidJob)


def seconds(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False,
            unit: str = "seconds") -> float:
    """A finite number of seconds (int or float, not a bool) within ``[lo, hi]`` (``(lo, hi]``)."""
    return check_seconds(name, value, hi, low=lo, low_open=lo_open, unit=unit, error=InvalidJob)


def job_fields(*, owner_id: Any, kind: Any, queue_name: Any, max_attempts: Any) -> None:
    """What accept() and NewJob/enqueue both require of a job."""
    text("owner_id", owner_id)
    text("kind", kind)
    queue("queue", queue_name)
    integer("max_attempts", max_attempts, 1)


def trace(traceparent: Any, tracestate: Any) -> tuple[str | None, str | None]:
    """The trace context to store: a malformed ``traceparent`` is dropped (with ``tracestate``)
    and logged, never failing the request; a non-string one is a programming error."""
    if traceparent is not None and not isinstance(traceparent, str):
        raise InvalidJob(f"traceparent must be None or a str, got {shown(traceparent)}")
    if tracestate is not None and not isinstance(tracestate, str):
        raise InvalidJob(f"tracestate must be None or a str, got {shown(tracestate)}")
    if traceparent is None:
        return None, None
    if not valid_traceparent(traceparent):
        _log.warning("trace_context_invalid", traceparent=traceparent[:100])
        return None, None
    return traceparent, kept_tracestate(tracestate)


def connection(conn: Any, *, asyncio: bool) -> None:
    """A psycopg connection of the API's kind: an asyncio one given to a sync function raised
    TypeError/AttributeError (and warned of a coroutine never awaited), a sync one given to
    consumer_sdk.jobs.aio ran its statement and then failed to await the cursor."""
    wanted = psycopg.AsyncConnection if asyncio else psycopg.Connection
    if isinstance(conn, wanted):
        return
    twin = ("" if not isinstance(conn, psycopg.AsyncConnection | psycopg.Connection)
            else ": use consumer_sdk.jobs.aio for an asyncio connection" if not asyncio
            else ": use consumer_sdk.jobs for a sync connection")
    raise InvalidJob(f"conn must be a psycopg.{wanted.__name__}, not {type(conn).__name__}{twin}")


def run_id(value: Any) -> str:
    """A run id (a ``uuid.UUID`` or its text) in canonical form."""
    if isinstance(value, uuid.UUID):
        return str(value)
    parsed = uuid_from_text(value)
    if parsed is not None:
        return str(parsed)
    raise InvalidJob(f"run_id must be a UUID (uuid.UUID or its text: 32 hex digits, optionally "
                     f"hyphenated or in braces), got {shown(value)}")
