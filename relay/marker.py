"""Marks acknowledged batches on connections of their own, in background threads.

While the pump claims and produces the next batches, a mark thread (:class:`Marker`, one
connection) marks the settled ones: the database works on a claim and a mark at once.
Batches queued behind the running mark are merged into the next statement (when their
lease tokens agree), so a slow mark costs fewer round trips, not more.  Results come back
as futures; the pump applies them on its own thread, in submission order.

:class:`relay.mark_lanes.MarkLanes` runs several mark threads (``--mark-connections``, two
by default).  A mark is a non-HOT update of every row it marks, about 20 µs of one backend's CPU a row on
this project's machines: while draining, the one marking backend was the relay's bound
(busy 69-98 % of a core, the second core half idle).  A large batch is split between the
lanes by shard, and a shard's mark never starts before its previous one ended, so the rows
of a key are marked in the order they were claimed, as on one connection.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from relay.errors import DatabaseReadOnly, DatabaseUnavailable, StatementCancelled
from relay.mark_cancels import MarkCancels
from relay.model import Lease, OutboxRow, RowId, ShardId, Token
from relay.wakeup import ReopenBackOff

#: What a mark returns: shards still held, ids marked, seconds the statement took.
MarkOutcome = tuple[set[ShardId], set[RowId], float]


class MarkStore(Protocol):
    def mark_published(self, *, owner: str, leases: list[Lease],
                       rows: list[OutboxRow]) -> tuple[set[ShardId], set[RowId]]: ...


@runtime_checkable
class ProbedStore(MarkStore, Protocol):
    """A mark store whose connection can be probed before it gets work (relay.store.Store)."""

    def ping(self) -> None: ...


#: A mark connection lost again within this many seconds of its previous loss is lost in a
#: row: its re-open waits a back-off, and the streak is said once.  Twice the back-off's cap
#: (relay/wakeup.py): a connection that lived longer than that is not flapping.
LOSS_STREAK_S = 60.0
#: How often a mark thread held back by its connection's back-off looks again (seconds).
HOLD_LOOK_S = 0.05


class MarkLosses:
    """One mark connection's losses in a row (the server ended it while the database
    answered: relay/app_deps.py), and the back-off on re-opening it after the second.

    A pooler or an ``idle_session_timeout`` ending the connection again and again, or a
    flapping route, cost a rewind at each loss (the marks in flight claimed again: rows
    published twice) and the connection re-opened at its next mark at once.  From the
    second loss in a row, the mark lanes send its work to the other connections, and its
    own thread waits until the back-off (:class:`relay.wakeup.ReopenBackOff`: 1 s doubling,
    up to 30 s) is over before it re-opens.  A loss more than :data:`LOSS_STREAK_S` after
    the previous one starts a new streak.  Written on the loop's thread, read on the mark
    threads (a count and a time: a stale read costs one look)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._back_off = ReopenBackOff(clock)
        self._last_at = float("-inf")

    def lost(self) -> bool:
        """Count a loss; True for the first of a streak, the one worth a log line."""
        now = self._clock()
        if now - self._last_at > LOSS_STREAK_S:
            self._back_off.passed()
        self._last_at = now
        return self._back_off.failed()

    @property
    def in_a_row(self) -> int:
        """The losses of the current streak (0: none)."""
        return self._back_off.failures

    def holding(self) -> bool:
        """Is the connection's re-open held back now (its second loss in a row or later)?"""
        return self._back_off.failures > 1 and not self._back_off.due()


def holding(store: object) -> bool:
    """Is ``store``'s re-open held back by its :class:`MarkLosses` (a store without: never)?"""
    losses = getattr(store, "losses", None)
    return isinstance(losses, MarkLosses) and losses.holding()


class MarkConnectionLost(DatabaseUnavailable):
    """The connection a mark ran on broke: whether its statement committed is unknown.

    Either the database went away, or the server ended only that backend
    (``pg_terminate_backend``, ``idle_session_timeout``, a pooler dropping it) while the
    other connections work: the loop tells which (relay/app_deps.py), and says
    ``mark_connection_lost`` for the second, not ``database_unavailable``.  Both rewind:
    the rows of the marks in flight are claimed again.  ``store``: the mark store whose
    connection broke (the loop names it); ``marks``: the mark statements it had committed
    then (relay.store.Store.marks; read at the break, as its thread may re-open and mark
    again before the loop looks)."""

    def __init__(self, message: str, *, store: object, marks: int = 0) -> None:
        super().__init__(message)
        self.store = store
        self.marks = marks


class MarkCancelled(StatementCancelled):
    """The server cancelled a mark statement (a ``statement_timeout`` shorter than the mark,
    an operator's ``pg_cancel_backend``): the database answers, the statement was too slow
    for it.  Nothing of it committed: the mark thread marks its rows again after a back-off
    (:class:`MarkCancels`).  It reaches the loop only when a stop ended the retries, or when
    no mark connection marked it: its rows are then claimed again (a rewind), said
    ``mark_statement_cancelled`` (relay/app_deps.py), not ``database_unavailable``.
    ``store``: the mark store whose statement it was."""

    def __init__(self, message: str, *, store: object, rows: int, took_s: float) -> None:
        super().__init__(message)
        self.store = store
        self.rows = rows  # in the statement cancelled
        self.took_s = took_s  # until it was cancelled: about the timeout


def mark_rows(store: MarkStore, owner: str, tokens: dict[ShardId, Token], rows: list[OutboxRow]) -> MarkOutcome:
    """Mark ``rows``, fenced by the lease ``tokens`` of their shards (the mark thread's
    statement, and the pump's own when it marks on its thread).  A broken connection raises
    :class:`MarkConnectionLost`, a cancelled statement :class:`MarkCancelled`; a read-only
    server its own error."""
    started = time.perf_counter()
    leases = [Lease(shard, token, 0.0) for shard, token in tokens.items()]
    try:
        held, marked = store.mark_published(owner=owner, leases=leases, rows=rows)
    except DatabaseReadOnly:
        raise
    except StatementCancelled as exc:
        raise MarkCancelled(str(exc), store=store, rows=len(rows),
                            took_s=time.perf_counter() - started) from exc
    except DatabaseUnavailable as exc:
        raise MarkConnectionLost(str(exc), store=store, marks=getattr(store, "marks", 0)) from exc
    return held, marked, time.perf_counter() - started


@dataclass(slots=True)
class _Job:
    tokens: dict[ShardId, Token]
    rows: list[OutboxRow]
    future: Future[MarkOutcome]
    after: tuple[Future[MarkOutcome], ...] = ()  # marks of other threads to wait for first


class Marker:
    """A single mark thread with its own store (connection)."""

    def __init__(self, store: MarkStore, owner: str, *, max_rows: int = 10_000,
                 name: str = "outbox-relay-mark", log: Any = None,
                 on_cancel: Callable[[str], None] = lambda connection: None) -> None:
        """``on_cancel``: counts a statement of the connection named so the server cancelled."""
        self.store = store
        self.owner = owner
        self.max_rows = max_rows
        self.name = name
        self.log = log
        self.on_cancel = on_cancel
        self.cancels = MarkCancels(log=log)  # its statements cancelled in a row, the back-off
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._held_back: _Job | None = None  # taken from the queue but not mergeable
        self._stop_taken = False  # the thread took the stop request from the queue
        self._stopping = threading.Event()  # set with the stop request: no more waiting

    def start(self) -> None:
        """Start the mark thread.  Idempotent; a stopped marker does not start again."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def submit(self, tokens: dict[ShardId, Token], rows: list[OutboxRow], *,
               after: tuple[Future[MarkOutcome], ...] = ()) -> Future[MarkOutcome]:
        """Queue a mark (run once the thread is started; a stopped marker marks nothing
        more); its outcome comes in the future.  ``after``: marks (of other threads,
        submitted earlier) that must end, one way or the other, before this one runs."""
        future: Future[MarkOutcome] = Future()
        self._queue.put(_Job(dict(tokens), rows, future, after))
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish what was submitted, then stop the thread (a daemon: a mark stuck on an
        unreachable database does not hold the process after ``timeout_s``).  Idempotent."""
        self.request_stop()
        self.join(timeout_s)

    def request_stop(self) -> None:
        """Ask the thread to stop after what was submitted, without waiting.  Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._thread is not None:
            self._queue.put(None)

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the thread to end (after :meth:`request_stop`)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run_once(self, timeout_s: float | None = None) -> int:
        """Mark the next submitted batch, merged with the batches queued behind it whose
        lease tokens agree, in one statement.  Waits up to ``timeout_s`` for a batch (None:
        until one comes).  Returns the rows of the statement: 0 when nothing came or when
        it took the stop request instead (``stopped`` tells)."""
        job = self._held_back
        self._held_back = None
        if job is None:
            try:
                job = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                return 0
        if job is None:
            self._stop_taken = True
            return 0
        if job.after:
            wait_futures(job.after)  # earlier marks of its shards, on another thread
        while holding(self.store) and not self._stopping.is_set():  # lost again and again:
            self._stopping.wait(HOLD_LOOK_S)  # its re-open waits (a stop marks what is left)
        jobs, tokens, size = [job], dict(job.tokens), len(job.rows)
        while size < self.max_rows:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._stop_taken = True  # after this statement
                break
            if (any(tokens.get(shard, token) != token for shard, token in nxt.tokens.items())
                    or not all(f.done() for f in nxt.after)):
                self._held_back = nxt  # a shard's lease changed, or it waits for another thread
                break
            jobs.append(nxt)
            tokens.update(nxt.tokens)
            size += len(nxt.rows)
        self._mark(jobs, tokens)
        return size

    @property
    def stopped(self) -> bool:
        """The stop request was taken: everything submitted before it is marked."""
        return self._stop_taken

    def _run(self) -> None:
        while not self._stop_taken:
            self.run_once()

    def _mark(self, jobs: list[_Job], tokens: dict[ShardId, Token]) -> None:
        rows = [row for job in jobs for row in job.rows]
        try:
            held, marked, took = self._mark_until_passed(tokens, rows)
        except Exception as exc:  # handed to the pump's thread, which handles it
            for job in jobs:
                job.future.set_exception(exc)
            return
        if len(jobs) == 1:  # the usual case: no set of ids to build
            jobs[0].future.set_result((held, marked, took))
            return
        for job in jobs:
            mine = {row.id for row in job.rows} & marked
            job.future.set_result((held, mine, took))

    @property
    def connection(self) -> str:
        """How log lines and metrics name this lane's connection (its application_name)."""
        return str(getattr(self.store, "name", self.name))

    def cancelled(self, exc: MarkCancelled) -> None:
        """Count a statement of this connection the server cancelled (said once a streak):
        its next try waits a back-off.  The pump's thread calls it for a mark it ran on this
        connection itself, while this thread was idle."""
        self.on_cancel(self.connection)
        self.cancels.cancelled(self.connection, exc)

    def _mark_until_passed(self, tokens: dict[ShardId, Token], rows: list[OutboxRow]) -> MarkOutcome:
        """Mark ``rows``, again while the server cancels the statement (:class:`MarkCancels`:
        the same rows and tokens after a back-off, then in parts, in order, without a wait
        when smaller).  Before, a cancel failed the marks and the loop rewound: every row of
        the marks in flight published again, and again at each cancel of a streak.  A stop
        ends the retries (the wait too): the cancel is raised, its rows stay pending."""
        cancels = self.cancels
        held, marked, took = set(tokens), set[RowId](), 0.0
        size, start, at_once = cancels.statement_rows(len(rows)), 0, False
        while start < len(rows):
            while not at_once and cancels.waiting() and not self._stopping.is_set():
                self._stopping.wait(HOLD_LOOK_S)
            part = rows[start:start + size]
            try:
                part_held, part_marked, part_took = mark_rows(self.store, self.owner, tokens, part)
            except MarkCancelled as exc:
                if self._stopping.is_set():
                    raise
                self.cancelled(exc)
                smaller = cancels.split(size)  # the same rows first, after a back-off; then parts
                at_once, size = smaller < size, smaller
                continue
            at_once = False
            cancels.passed(self.connection, size)
            held &= part_held
            marked |= part_marked
            took += part_took
            start += len(part)
        return held, marked, took
