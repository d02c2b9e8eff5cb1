"""Marks acknowledged batches on a second connection, in one background thread.

While the pump claims and produces the next batches, this thread marks the settled
ones: the database works on a claim and a mark at once.  Batches queued behind the
running mark are merged into the next statement (when their lease tokens agree), so
a slow mark costs fewer round trips, not more.  Results come back as futures, in
submission order; the pump applies them on its own thread.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from relay.model import Lease, OutboxRow, RowId, ShardId, Token

#: What a mark returns: shards still held, ids marked, seconds the statement took.
MarkOutcome = tuple[set[ShardId], set[RowId], float]


class MarkStore(Protocol):
    def mark_published(self, *, owner: str, leases: list[Lease],
                       rows: list[OutboxRow]) -> tuple[set[ShardId], set[RowId]]: ...


def mark_rows(store: MarkStore, owner: str, tokens: dict[ShardId, Token], rows: list[OutboxRow]) -> MarkOutcome:
    """Mark ``rows``, fenced by the lease ``tokens`` of their shards (the mark thread's
    statement, and the pump's own when it marks on its thread)."""
    started = time.perf_counter()
    leases = [Lease(shard, token, 0.0) for shard, token in tokens.items()]
    held, marked = store.mark_published(owner=owner, leases=leases, rows=rows)
    return held, marked, time.perf_counter() - started


@dataclass(slots=True)
class _Job:
    tokens: dict[ShardId, Token]
    rows: list[OutboxRow]
    future: Future[MarkOutcome]


class Marker:
    """A single mark thread with its own store (connection)."""

    def __init__(self, store: MarkStore, owner: str, *, max_rows: int = 10_000) -> None:
        self.store = store
        self.owner = owner
        self.max_rows = max_rows
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._held_back: _Job | None = None  # taken from the queue but not mergeable
        self._stop_taken = False  # the thread took the stop request from the queue

    def start(self) -> None:
        """Start the mark thread.  Idempotent; a stopped marker does not start again."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="outbox-relay-mark", daemon=True)
            self._thread.start()

    def submit(self, tokens: dict[ShardId, Token], rows: list[OutboxRow]) -> Future[MarkOutcome]:
        """Queue a mark (run once the thread is started; a stopped marker marks nothing
        more); its outcome comes in the future."""
        future: Future[MarkOutcome] = Future()
        self._queue.put(_Job(dict(tokens), rows, future))
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish what was submitted, then stop the thread (a daemon: a mark stuck on an
        unreachable database does not hold the process after ``timeout_s``).  Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._queue.put(None)
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
        jobs, tokens, size = [job], dict(job.tokens), len(job.rows)
        while size < self.max_rows:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._stop_taken = True  # after this statement
                break
            if any(tokens.get(shard, token) != token for shard, token in nxt.tokens.items()):
                self._held_back = nxt  # a shard's lease changed between the two batches
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
            held, marked, took = mark_rows(self.store, self.owner, tokens, rows)
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
