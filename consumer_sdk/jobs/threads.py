"""A worker pool's threads: started by kind, and ended by one deadline when the pool stops.

``WorkerPool.stop()`` waits for each kind of thread (dispatcher, executors, the last
completions, heartbeat) only for the time left until its deadline, then lets go
(:meth:`PoolThreads.let_go`): the pool's connection factory opens no connection any
more, and the threads still busy (waiting on a database that does not answer, or a
handler that ignores its cancellation) get their connections' sockets shut down, so a
statement they wait on fails at once and they end (:mod:`consumer_sdk.jobs._conn`).  A
thread is never waited for beyond the deadline: a partition cannot hold stop() (an audit
of the pool: 46 s, one thread after the other, each waiting for TCP).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class PoolThreads:
    """The pool's daemon threads by kind (``dispatch``, ``executor``, ``heartbeat``, ...)."""

    def __init__(self) -> None:
        self._by_kind: dict[str, list[threading.Thread]] = {}

    def start(self, kind: str, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._by_kind.setdefault(kind, []).append(thread)
        thread.start()
        return thread

    def __getitem__(self, kind: str) -> list[threading.Thread]:
        return self._by_kind.get(kind, [])

    def started(self, kind: str) -> bool:
        return kind in self._by_kind

    def running(self, kind: str) -> bool:
        return any(thread.is_alive() for thread in self._by_kind.get(kind, []))

    def join(self, kind: str, until: float) -> bool:
        """Wait for the threads of ``kind`` until ``until`` (monotonic); True when all ended."""
        for thread in self._by_kind.get(kind, []):
            thread.join(left(until))
        return not self.running(kind)

    def alive(self, others: Sequence[threading.Thread | None] = ()) -> list[str]:
        threads = [t for kind in self._by_kind.values() for t in kind] + [t for t in others if t is not None]
        return [thread.name for thread in threads if thread.is_alive()]

    def let_go(self, connect: Any, log: Any, end: float, others: Sequence[threading.Thread | None] = ()) -> None:
        """The end of stop(): ``connect`` (a :class:`~consumer_sdk.jobs._conn.PoolerAware`)
        opens no connection any more; when threads are still busy, the sockets of its
        connections are shut down and they are waited for until ``end``."""
        stuck = self.alive(others)
        shut = connect.shut_down(sockets=bool(stuck))
        if not stuck:
            return
        log.warning("pool_stop_abandoned", threads=stuck, connections_shut=shut,
                    detail="still busy at the end of stop(): their connections were shut down, "
                           "and what they were writing is left to the leases")
        for kind in self._by_kind:
            self.join(kind, end)
        for thread in others:
            if thread is not None:
                thread.join(left(end))


def left(until: float) -> float:
    """Seconds from now until ``until`` (monotonic), never negative."""
    return max(0.0, until - time.monotonic())
