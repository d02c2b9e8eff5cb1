"""The worker pool's LISTEN thread while its database is unreachable, on a real PostgreSQL behind
the fault proxy (``cut()``: connections reset, new ones refused, as a database stopped does).

It logged ``listen_failed`` at every attempt (back-off up to 5 s: about every 5 s for as long
as the database was down, next to the dispatcher's single line).  Now a streak of failures is
one ``listen_failed`` (the error, masked; again every 30 s with the count) and one
``listen_recovered`` when it listens again; the next streak is logged again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import WorkerConfig
from consumer_sdk.jobs._conn import pool_connect_factory
from consumer_sdk.jobs.wake import Listener
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import recording_logger

#: Attempts to see failing in a streak (back-off 0.1 s doubling: the sixth about 6 s in).
ATTEMPTS = 6


class Counting:
    """The pool's own connection factory, its attempts counted."""

    def __init__(self, dsn: str) -> None:
        self._connect = pool_connect_factory(WorkerConfig(dsn=dsn))
        self.attempts = 0
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        with self._lock:
            self.attempts += 1
        return self._connect()


def _events(logged: list[dict[str, Any]], name: str, since: float) -> list[dict[str, Any]]:
    return [e for e in logged if e["event"] == name and e["at"] >= since]


def test_the_listener_logs_a_streak_of_failures_once_and_its_end_once(jobs_db: str, tcp_proxy: Any) -> None:
    info = conninfo_to_dict(jobs_db)
    proxy = tcp_proxy(str(info.get("host") or "127.0.0.1"), int(str(info["port"])))
    connect = Counting(make_conninfo(jobs_db, host="127.0.0.1", port=str(proxy.port)))
    logged: list[dict[str, Any]] = []
    wakes: list[str | None] = []
    listener = Listener(connect, wakes.append, log=recording_logger(logged))
    listener.start()
    try:
        wait_until(listener.connected.is_set, timeout_s=10, message="listening")
        for streak in (1, 2):  # each streak is logged again
            cut_at, attempts = time.monotonic(), connect.attempts
            proxy.cut()
            wait_until(lambda attempts=attempts: connect.attempts >= attempts + ATTEMPTS, timeout_s=20,
                       message=lambda: f"{connect.attempts} attempts {[e['event'] for e in logged[-5:]]}")
            assert not listener.connected.is_set()
            failed = _events(logged, "listen_failed", cut_at)
            assert len(failed) == 1, f"streak {streak}: {len(failed)} lines for {connect.attempts - attempts} attempts"
            assert failed[0]["failures"] == 1 and failed[0]["error"], failed
            password = str(info.get("password") or "")
            assert not password or password not in failed[0]["error"]
            back_at = time.monotonic()
            proxy.restore()
            wait_until(listener.connected.is_set, timeout_s=15, message="listening again")
            (recovered,) = wait_until(lambda cut_at=cut_at: _events(logged, "listen_recovered", cut_at),
                                      timeout_s=2, message="no listen_recovered")
            assert recovered["at"] >= back_at and recovered["failures"] >= ATTEMPTS - 1, recovered
            assert len(_events(logged, "listen_failed", cut_at)) == 1
    finally:
        proxy.restore()
        listener.stop()
    assert not [e for e in logged if e["event"] == "listen_stopped"]
