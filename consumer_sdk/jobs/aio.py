"""asyncio twins of :func:`~consumer_sdk.jobs.accept`, :func:`~consumer_sdk.jobs.run_status`
and :func:`~consumer_sdk.jobs.activate`, for ``psycopg.AsyncConnection``.

Same guarantees, same SQL, same validation and branching: each function runs the
plan its sync twin runs (:mod:`consumer_sdk.jobs._plan`); only the await differs.
For an asyncio web service (the HTTP front of long work) without worker threads::

    from consumer_sdk.jobs import aio as jobs

    run = await jobs.accept(conn, owner_id=user, request_key=key, kind="report", body=body)
    state = await jobs.run_status(conn, run.run_id, owner_id=user)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import psycopg

from consumer_sdk.jobs import _check, aborted
from consumer_sdk.jobs._db import translated
from consumer_sdk.jobs._plan import run_async
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import (
    INTERACTIVE,
    Accepted,
    Activation,
    AdmissionPolicy,
    RunId,
    RunState,
)
from consumer_sdk.jobs.runs import (
    accept_plan,
    accepted_done,
    check_idle,
    check_options,
    make_request,
    status_plan,
)
from consumer_sdk.jobs.waits import activate_plan

AsyncConnectionT = psycopg.AsyncConnection[Any]

#: Awaited inside accept's transaction after the run is inserted: write your own rows there.
AsyncAcceptHook = Callable[[AsyncConnectionT, Accepted], Awaitable[None]]


async def accept(
    conn: AsyncConnectionT,
    *,
    owner_id: str,
    request_key: str,
    kind: str,
    body: Any,
    queue: str = INTERACTIVE,
    max_attempts: int = 5,
    traceparent: str | None = None,
    tracestate: str | None = None,
    admission: AdmissionPolicy | None = None,
    events_topic: str | None = None,
    on_accept: AsyncAcceptHook | None = None,
    metrics: JobsMetrics | None = None,
    now: datetime | None = None,
) -> Accepted:
    """:func:`consumer_sdk.jobs.accept` on an asyncio connection (not inside a transaction).

    An ``on_accept`` hook that caught a database error and returned left the transaction
    aborted: nothing is stored, and accept raises what the error stands for
    (:mod:`consumer_sdk.jobs.aborted`: a conflict or a read-only database as when not caught,
    else :class:`~consumer_sdk.errors.HandlerTransactionFailed`)."""
    check_options(admission=admission, events_topic=events_topic, metrics=metrics, on_accept=on_accept)
    request = make_request(owner_id=owner_id, request_key=request_key, kind=kind, body=body, queue=queue,
                           max_attempts=max_attempts, traceparent=traceparent, tracestate=tracestate)
    check_idle(conn, asyncio=True)
    with translated():
        async with conn.transaction():
            accepted = await run_async(conn, accept_plan(request, admission, metrics, now, events_topic))
            if accepted.created and on_accept is not None:
                trips = aborted.watch_hook(conn)  # a hook that caught an error: consumer_sdk/jobs/aborted.py
                await on_accept(conn, accepted)
                aborted.check_hook(conn, trips)
    return accepted_done(request, accepted, metrics)


async def run_status(conn: AsyncConnectionT, run_id: RunId | str, *, owner_id: str | None = None,
                     now: datetime | None = None) -> RunState | None:
    """:func:`consumer_sdk.jobs.run_status` on an asyncio connection."""
    plan = status_plan(run_id, owner_id, now)  # checks the arguments first
    _check.connection(conn, asyncio=True)
    with translated():
        return await run_async(conn, plan)


async def activate(conn: AsyncConnectionT, key: str, payload: Any = None, *, now: datetime | None = None,
                   events_topic: str | None = None) -> Activation:
    """:func:`consumer_sdk.jobs.activate` on an asyncio connection (a savepoint inside the
    caller's transaction, else a transaction of its own)."""
    plan = activate_plan(key, payload, now, events_topic)  # checks the arguments first
    _check.connection(conn, asyncio=True)
    with translated():
        async with conn.transaction():
            return await run_async(conn, plan)


__all__ = ["AsyncAcceptHook", "accept", "activate", "run_status"]
