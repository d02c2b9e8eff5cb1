"""The statement clock's rules (consumer_sdk/jobs/statement_clock.py), with a connection whose
server is the test: a 57014 is the pool's statement_timeout, in any words, only when it ends a
wait on a session of the pool's own timeout that lasted that timeout (less a margin), and only
right after that wait.  (The real server and timeout: tests/integration/jobs/test_jobs_timeout_any_language.py.)"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import psycopg.errors as pg
import pytest

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs._db import translated
from consumer_sdk.jobs.errors import StatementTimedOut
from consumer_sdk.jobs.statement_clock import FRESH_S, MARGIN_S, TimedWaits

GERMAN = "Abbruch der Anweisung wegen Zeitüberschreitung"


class _Server(psycopg.Connection[Any]):
    """No socket: each wait lasts ``lasts`` seconds of the test's clock, then raises ``error``."""

    def __init__(self, *, timeout_s: float | None, base: float) -> None:  # psycopg's own: not called
        self.now, self.lasts, self.error = base, 0.0, pg.QueryCanceled(GERMAN)
        self.statement_timeout_s = timeout_s

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.now += self.lasts
        raise self.error

    def __del__(self) -> None:  # nothing to close
        pass


class _Timed(TimedWaits, _Server):
    def clock(self) -> float:
        return self.now


def _cancelled(conn: _Timed, lasts: float) -> BaseException:
    conn.lasts = lasts
    with pytest.raises(DatabaseUnavailable) as raised, translated():
        conn.wait(None)
    return raised.value


def test_a_57014_ending_a_wait_as_long_as_the_pools_timeout_is_its_timeout_in_any_words() -> None:
    conn = _Timed(timeout_s=0.5, base=time.monotonic())
    assert isinstance(_cancelled(conn, 0.5 - MARGIN_S / 2), StatementTimedOut)
    assert isinstance(_cancelled(conn, 3.0), StatementTimedOut)  # a wait that sent several statements


def test_a_57014_before_the_timeout_or_on_another_session_is_not_a_timeout() -> None:
    base = time.monotonic()
    conn = _Timed(timeout_s=0.5, base=base)
    assert type(_cancelled(conn, 0.5 - 2 * MARGIN_S)) is DatabaseUnavailable  # a cancel request's
    handlers = _Timed(timeout_s=None, base=base)  # a handler's session: the pool set no timeout
    assert type(_cancelled(handlers, 5.0)) is DatabaseUnavailable


def test_only_the_last_wait_of_the_thread_and_only_at_once_tells_a_timeout() -> None:
    base = time.monotonic()
    pools, handlers = _Timed(timeout_s=0.5, base=base), _Timed(timeout_s=None, base=base)
    pools.lasts, pools.error = 1.0, pg.QueryCanceled(GERMAN)
    with pytest.raises(pg.QueryCanceled):
        pools.wait(None)  # a timed-out wait, its error not translated
    assert type(_cancelled(handlers, 0.0)) is DatabaseUnavailable  # the handler's wait came after it
    stale = _Timed(timeout_s=0.5, base=base - 5 * FRESH_S)  # its wait ended long ago
    stale.lasts = 1.0
    with pytest.raises(pg.QueryCanceled):
        stale.wait(None)
    with pytest.raises(DatabaseUnavailable) as raised, translated():
        raise pg.QueryCanceled(GERMAN)  # an error of another connection's, no wait of its own
    assert type(raised.value) is DatabaseUnavailable
