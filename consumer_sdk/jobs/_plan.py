"""One model for sync and asyncio: database work written once, as a plan of statements.

A *plan* is a generator that yields :class:`Step` (a named query, its parameters,
what to fetch) and receives each step's rows; its return value is the result.  The
logic (validation, branching, what to write next) lives in the plan, once; the two
drivers, :func:`run` for ``psycopg.Connection`` and :func:`run_async` for
``psycopg.AsyncConnection``, only execute.  This is how :mod:`consumer_sdk.jobs.aio`
twins the sync API without a second copy of it (conventions, habit 15).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import psycopg

from consumer_sdk.jobs.events import EventType, JobFacts, job_event
from consumer_sdk.outbox_encoding import prepare
from outbox_core.queries import query

T = TypeVar("T")
Fetch = Literal["one", "all", "none"]


@dataclass(frozen=True, slots=True)
class Step:
    """One statement of a plan: SQL text of a named block, its parameters, what comes back."""

    sql: str
    params: Mapping[str, Any]
    fetch: Fetch = "one"


Plan = Generator[Step, Any, T]


def step(name: str, params: Mapping[str, Any], fetch: Fetch = "one") -> Step:
    """A step running the named block ``name`` of ``sql/queries/jobs.sql``."""
    return Step(query("jobs", name), params, fetch)


def event_step(topic: str, event_type: EventType, facts: JobFacts) -> Step:
    """The outbox insert of a run or job event (in the plan's transaction)."""
    return Step(query("sdk_outbox", "insert_events"), prepare([job_event(topic, event_type, facts)]).params,
                "none")


def run(conn: psycopg.Connection[Any], plan: Plan[T]) -> T:
    """Execute ``plan`` on a sync connection; returns the plan's result."""
    try:
        current = next(plan)
        while True:
            cur = conn.execute(current.sql, current.params)
            current = plan.send(_rows(cur.fetchone, cur.fetchall, current.fetch))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def run_async(conn: psycopg.AsyncConnection[Any], plan: Plan[T]) -> T:
    """Execute ``plan`` on an asyncio connection; returns the plan's result."""
    try:
        current = next(plan)
        while True:
            cur = await conn.execute(current.sql, current.params)
            if current.fetch == "one":
                rows: Any = await cur.fetchone()
            elif current.fetch == "all":
                rows = await cur.fetchall()
            else:
                rows = None
            current = plan.send(rows)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _rows(one: Any, many: Any, fetch: Fetch) -> Any:
    if fetch == "one":
        return one()
    return many() if fetch == "all" else None
