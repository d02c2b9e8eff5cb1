"""A worker pool's claimed jobs: lined up (claimed, not started yet) or running a handler.

The dispatcher claims ahead of its free executors when jobs are short, so that a round
trip of its claim (which grows with the machine's load, not with the jobs claimed) is
paid for many jobs and no executor waits for it: up to ``depth`` jobs wait in line,
leased to the pool (the heartbeat renews them) and counted against the owner limits
like running ones.  Executors take the next job of the first queue, in the pool's
priority order, whose limit allows one more to *run*: lined-up bulk jobs never take the
slots kept for interactive work.  Long jobs are not claimed ahead (``depth`` 0): a job
waiting in one pool's line while another pool idles would wait a long job's time.

The line also counts the payload bytes its jobs hold (``payload_bytes``, each job's size as
its claim counted it), from :meth:`add` to :meth:`done`: the one place a job's attempt ends,
whatever its outcome, so the pool's ``max_payload_bytes`` bounds what it holds, not what a
round brings.

Not thread-safe by itself: the pool calls it under its lock; executors wait on ``ready``
(a condition on that same lock).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence

from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.fairness import Limits

#: Jobs whose handlers take at most this long on average are claimed ahead.
SHORT_JOB_S = 0.05


class Line:
    """Per queue: the jobs waiting to start, and how many run; executors block in :meth:`take`."""

    def __init__(self, *, queues: Sequence[str], limits: Limits, ready: threading.Condition) -> None:
        self.queues = list(queues)
        self.ready = ready
        self.max_concurrency = limits.max_concurrency
        self._run_limit = {q: limits.for_queue(q) for q in self.queues}
        self._waiting: dict[str, deque[JobContext]] = {q: deque() for q in self.queues}
        self.running: Counter[str] = Counter()  # handlers running, per queue
        self.held: Counter[str] = Counter()  # running + waiting, per queue
        self.total = 0  # sum(held)
        self.payload_bytes = 0  # the held jobs' payload_bytes (see the module's docstring)
        self.closed = False
        self._avg_s = 1.0  # handlers' average duration (moving); long until measured
        #: Claim ahead: as many as the pool runs at once, twice over, while jobs are short.
        self.max_depth = 2 * limits.max_concurrency
        #: The limits to plan claims with: the pool's, widened by the line's depth.
        self.ahead = Limits(max_concurrency=limits.max_concurrency + self.max_depth,
                            queue_limits={q: n + self.max_depth for q, n in limits.queue_limits.items()},
                            owner_limit=limits.owner_limit, owner_limits=limits.owner_limits)

    @property
    def depth(self) -> int:
        return self.max_depth if self._avg_s <= SHORT_JOB_S else 0

    @property
    def capacity(self) -> int:
        return self.max_concurrency + self.depth

    def add(self, contexts: Sequence[JobContext]) -> None:
        for ctx in contexts:
            self._waiting[ctx.job.queue].append(ctx)
            self.held[ctx.job.queue] += 1
            self.payload_bytes += ctx.job.payload_bytes
        self.total += len(contexts)
        self.ready.notify(len(contexts))

    def take(self) -> JobContext | None:
        """The next job an executor may start (waits for one); None once closed."""
        while not self.closed:
            for queue in self.queues:
                waiting = self._waiting[queue]
                if waiting and self.running[queue] < self._run_limit[queue]:
                    self.running[queue] += 1
                    return waiting.popleft()
            self.ready.wait()
        return None

    def done(self, ctx: JobContext, duration_s: float) -> None:
        """A handler ended (its completion may still be on its way)."""
        self.running[ctx.job.queue] -= 1
        self.held[ctx.job.queue] -= 1
        self.total -= 1
        self.payload_bytes -= ctx.job.payload_bytes
        self._avg_s += (duration_s - self._avg_s) / 8

    def waiting(self) -> list[JobContext]:
        return [ctx for line in self._waiting.values() for ctx in line]

    def close(self) -> None:
        self.closed = True
        self.ready.notify_all()
