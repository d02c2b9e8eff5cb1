"""The machine's price of one round trip to PostgreSQL, timed beside a benchmark's figures.

This project's machines are shared.  On 2026-12-04 the relay's steady CPU at 1,000
events/s read 8.3-9.3 % of a core at 14:00 UTC and 13.3-15.2 % at 14:20 on the same code,
and a bare round trip took 104-151 µs where issue 19 had measured about 39 µs.  The
figures made mostly of round trips and wake-ups (one message at a time, the worker pools,
a paced claim cycle) move with that price, so the benchmarks time it beside them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import psycopg


class Measure:
    """Wall and own-process CPU time of what runs inside it (every thread of this process)."""

    def __enter__(self) -> Measure:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0

    def figures(self, items: int) -> dict[str, float]:
        return {"rate": items / self.wall, "cpu_us": 1e6 * self.cpu / items}


T = TypeVar("T")


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` in the order round ``round_index`` runs them: each round starts one further
    along, so that no variant always runs first or last while the machine drifts."""
    start = round_index % len(items) if items else 0
    return [*items[start:], *items[:start]]


#: Round trips timed by default: a few tenths of a second on a busy day.
ROUND_TRIPS = 2000


def round_trip(dsn: str, count: int = ROUND_TRIPS) -> dict[str, float]:
    """One round trip's wall time and this process's CPU time, in µs: ``SELECT 1``,
    prepared, ``count`` times on one autocommit connection (after ten that prepare it)."""
    if count < 1:
        raise ValueError("count must be at least 1")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(10):
            conn.execute("SELECT 1", prepare=True)
        with Measure() as m:
            for _ in range(count):
                conn.execute("SELECT 1", prepare=True)
    return {"wall_us": round(1e6 * m.wall / count, 1), "cpu_us": round(1e6 * m.cpu / count, 1)}


def write_json(path: str | None, figures: Any) -> None:
    """A benchmark's figures as indented JSON in ``path`` (its ``--json``; None: nothing)."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)
            f.write("\n")
