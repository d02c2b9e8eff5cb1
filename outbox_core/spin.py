"""Waiting for PostgreSQL's answer by polling its socket for a few tens of microseconds
before sleeping on it.

A client that sleeps on its socket after each statement is woken when the answer comes;
on the virtual machines these services run on that wake-up is most of a short round
trip: on this project's machines (KVM, 2 vCPUs) a ``SELECT 1`` took 75-90 µs of wall
clock when the client slept for it and 27-30 µs when it polled the socket without
sleeping, for the same client CPU.  Code that runs one short transaction after another
(one message at a time, a job's fenced writes) waits out a wake-up two or three times per
item.

:class:`SpinningConnection` is a ``psycopg.Connection`` whose waits for an answer first
poll the socket (``poll`` with a zero timeout) for up to ``budget_s``, and sleep on it as
psycopg does only when nothing came by then.  Everything else is psycopg's: the
connection is one, with the same API, errors and Ctrl-C handling.

What it costs: while it polls the client burns CPU instead of sleeping, up to the budget
per wait.  An answer that comes later than the budget (a slow statement, a database across
a network) pays the budget for nothing, so :class:`Spinner` stops polling after a few such
misses in a row and tries again after a number of waits that doubles each time the try
misses too (up to :data:`SKIP_MAX`): a client whose answers never come within the budget
polls on about one wait in a thousand.  A budget of 0 turns it off.

Under a CPU limit (a container's, see :mod:`outbox_core.cgroup`) every microsecond a poll
spends counts against the quota, and a process that spends its quota is stopped until the
next period: :func:`default_budget_us` leaves polling off by default below one core.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Generator
from typing import Any

import psycopg
from psycopg.waiting import Ready, Wait  # re-exported there by psycopg

#: Misses in a row after which the spinner stops polling for a while.
MISSES_BEFORE_PAUSE = 4
#: Waits without polling after the first pause; doubled after each missed try.
SKIP_MIN = 16
SKIP_MAX = 1024

#: Below this CPU limit (cores) polling is off unless asked for: a one-at-a-time consumer
#: limited to 0.5 core moved 0.75-0.86 x the messages a second polling 100 µs that it moved
#: sleeping at once, to 0.25 core 0.58-0.79 x; limited to one core, 1.41-1.46 x (README).
MIN_LIMIT_CORES = 1.0

#: Polling needs select.poll (not on Windows) and psycopg's Connection.wait (3.1 and later).
AVAILABLE = hasattr(select, "poll") and callable(getattr(psycopg.Connection, "wait", None))
_POLL_IN = (select.POLLIN | select.POLLERR | select.POLLHUP) if AVAILABLE else 0


def default_budget_us(asked_us: float | None, default_us: float,
                      limit_cores: Callable[[], float | None]) -> tuple[float, float | None]:
    """The budget to poll for: ``asked_us`` when given; otherwise ``default_us``, or 0
    when ``limit_cores()`` (this process's CPU limit) is under :data:`MIN_LIMIT_CORES`.
    Returns (budget in µs, the limit that turned it off or None)."""
    if asked_us is not None:
        return asked_us, None
    limit = limit_cores()
    if limit is not None and limit < MIN_LIMIT_CORES:
        return 0.0, limit
    return default_us, None


class Spinner:
    """Whether to poll before sleeping, and the polling itself, for one connection (used by
    one thread at a time, as the connection is)."""

    def __init__(self, budget_s: float, *, clock: Callable[[], float] = time.perf_counter) -> None:
        if not budget_s >= 0:  # NaN too
            raise ValueError(f"a spin budget is 0 (off) or more seconds, not {budget_s!r}")
        self.budget_s = budget_s
        self._clock = clock
        self.hits = 0  # answers that came while polling
        self.misses = 0  # polls that spent the budget, then slept
        self.skipped = 0  # waits that slept at once (paused)
        self._in_a_row = 0
        self._skip = SKIP_MIN
        self._skip_left = 0
        self._fd = -1
        self._poller: Any = None

    def __repr__(self) -> str:
        return (f"Spinner(budget_s={self.budget_s}, hits={self.hits}, misses={self.misses}, "
                f"skipped={self.skipped})")

    @property
    def enabled(self) -> bool:
        return self.budget_s > 0

    def wants(self) -> bool:
        """Poll this wait (False while paused after misses; the pause counts down)."""
        if self._skip_left > 0:
            self._skip_left -= 1
            self.skipped += 1
            return False
        return True

    def record(self, hit: bool) -> None:
        if hit:
            self.hits += 1
            self._in_a_row = 0
            self._skip = SKIP_MIN
            return
        self.misses += 1
        self._in_a_row += 1
        if self._in_a_row >= MISSES_BEFORE_PAUSE:
            self._skip_left = self._skip  # the try after the pause, if it misses, pauses again
            self._skip = min(self._skip * 2, SKIP_MAX)

    def poll(self, ready: Callable[[], bool]) -> bool:
        """Call ``ready`` until it is true or the budget is spent; whether it became true."""
        deadline = self._clock() + self.budget_s
        while True:
            if ready():
                return True
            if self._clock() >= deadline:
                return False

    def readable(self, fileno: int) -> Callable[[], bool]:
        """A non-blocking check that ``fileno`` has something to read (or an error)."""
        if fileno != self._fd or self._poller is None:
            self._poller = select.poll()
            self._poller.register(fileno, _POLL_IN)
            self._fd = fileno
        poll = self._poller.poll
        return lambda: bool(poll(0))


def spinning(gen: Generator[Any, Any, Any], fileno: int, spinner: Spinner) -> Generator[Any, Any, Any]:
    """``gen``, one of psycopg's generators, with each wait to read polled first: when the
    socket turns readable within the budget, ``gen`` is told so without the waiter sleeping;
    otherwise the wait goes to psycopg's waiter as it came."""
    try:
        state = next(gen)
        readable = None
        while True:
            if state == Wait.R and spinner.wants():
                if readable is None:
                    readable = spinner.readable(fileno)
                hit = spinner.poll(readable)
                spinner.record(hit)
                if hit:
                    state = gen.send(Ready.R)
                    continue
            state = gen.send((yield state))
    except StopIteration as stop:
        return stop.value


class SpinningConnection(psycopg.Connection[Any]):
    """A psycopg connection whose waits for an answer poll first (see the module).  Its
    :attr:`spinner` is set by :func:`connect`; without one it waits as psycopg does."""

    spinner: Spinner | None = None

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        spinner = self.spinner
        if spinner is None or not spinner.enabled:
            return super().wait(gen, *args, **kwargs)
        return super().wait(spinning(gen, self.pgconn.socket, spinner), *args, **kwargs)


def connect(dsn: str, *, spin_s: float, plain: type[psycopg.Connection[Any]] = psycopg.Connection,
            spinning: type[SpinningConnection] = SpinningConnection, **kwargs: Any) -> psycopg.Connection[Any]:
    """``plain.connect(dsn, **kwargs)``; with ``spin_s`` > 0 a ``spinning`` connection (a
    :class:`SpinningConnection`) polling for up to ``spin_s`` a wait (a ``plain`` one where
    it cannot: see :data:`AVAILABLE`)."""
    spinner = Spinner(spin_s)  # a bad budget fails before connecting
    if not spinner.enabled or not AVAILABLE:
        return plain.connect(dsn, **kwargs)
    conn = spinning.connect(dsn, **kwargs)
    conn.spinner = spinner
    return conn
