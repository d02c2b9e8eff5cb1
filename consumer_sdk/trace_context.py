"""The W3C trace context an event or a job carries: which ``traceparent`` is kept, which
``tracestate`` beside it.

Events (:mod:`consumer_sdk.outbox_encoding`) and jobs (:mod:`consumer_sdk.jobs._check`)
keep the same: trace context never fails a write, so what is not kept is dropped, never
refused.  Patterns are matched with ``fullmatch`` (``$`` would accept a trailing newline).
"""

from __future__ import annotations

import re

from outbox_core.text import refuse_unstorable

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
#: The longest tracestate kept (W3C: 32 list members; longer is dropped, never refused).
MAX_TRACESTATE_CHARS = 512


def valid_traceparent(value: str) -> bool:
    """A W3C ``traceparent`` of a known shape, not the invalid all-zero ids or version ff."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, _flags = match.groups()
    return version != "ff" and trace_id != "0" * 32 and parent_id != "0" * 16


def kept_tracestate(tracestate: str | None) -> str | None:
    """The ``tracestate`` stored beside a valid traceparent, or None: one longer than
    ``MAX_TRACESTATE_CHARS`` or that PostgreSQL cannot store (a NUL character, a lone
    surrogate) is dropped, never refused.  Events and jobs keep the same (a NUL in an event's
    tracestate failed the business transaction, where a job's was dropped)."""
    if tracestate is None or len(tracestate) > MAX_TRACESTATE_CHARS:
        return None
    try:
        return refuse_unstorable("tracestate", tracestate, ValueError)
    except ValueError:
        return None
