"""Keeping the group membership while one transaction runs longer than ``max.poll.interval.ms``.

librdkafka leaves the group when the application has not polled for
``max.poll.interval.ms``.  The batch loop polls between two transactions
(:meth:`~consumer_sdk.inbox_group.InboxGroup._keep_membership`), but not inside one: a
handler call, or a batch (``batch_size > 1``), longer than the interval made the member
leave, its partitions moved to another member and came back as duplicates, at every such
transaction.

:class:`KafkaKeeper` is a thread that polls in the loop's stead while a transaction runs
long.  The loop *lends* it the Kafka consumer for the time the processor runs
(:meth:`KafkaKeeper.lent`); once nothing polled for ``after_s`` (more than the half of the
interval at which the loop polls itself, so that the two rarely meet), the keeper takes the
consumer, and its ``keep`` (``InboxGroup._keep_beside``) pauses the assignment and polls
with short timeouts until the loop wants the consumer back.  The loop takes it back
(:meth:`KafkaKeeper.held`) for every use of the consumer while it is lent (the offsets
committed after each transaction, a back-off's keep-alive wait): the keeper's current poll
ends (at most ``keep``'s poll timeout), the partitions are resumed, and the loop goes on.

So the consumer is used by one thread at a time (librdkafka would allow more, but the
callbacks and the books they keep would then run on two threads at once).  Rebalance
callbacks run on the keeper's thread while the handler runs: a revoke commits only what
committed transactions applied and forgets the partitions; the transaction in flight,
committing afterwards, settles no offset of them (``InboxOffsets._settled``), and its effect
is once because of the inbox (the next owner's claim waits for it, then finds the row).

Meanwhile none of the member's partitions progresses: a keeper gives up beside a transaction
after ``InboxConfig.keep_membership_max_intervals`` intervals (``membership_released``), not
before the next loan, and the member then leaves its group one interval later as before the
keeper: a slow transaction keeps its member, a hung one does not hold its partitions for ever.

A keeper does not start before :meth:`KafkaKeeper.start` (a group member only: an assigned
reader has no membership to keep).  :meth:`KafkaKeeper.stop` is idempotent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: How often the idle keeper looks whether the consumer went unpolled for ``after_s``.
LOOK_EVERY_S = 0.5


class KafkaKeeper:
    """The thread that polls Kafka beside a long transaction; see the module's docstring.

    ``keep(hand_back)``: poll, the assignment paused, until ``hand_back()`` is true, then
    resume it; True when it gave up instead (the transaction ran too long: not kept again
    until the loan ends); ``idle_s()``: seconds since the consumer was last polled (by either thread);
    ``after_s``: how long unpolled before the keeper takes over.  ``sessions`` counts the
    times it did (tests read it)."""

    thread_name = "outbox-consumer-keeper"

    def __init__(self, keep: Callable[[Callable[[], bool]], bool], *, idle_s: Callable[[], float],
                 after_s: float, log: Any) -> None:
        self._keep, self._idle_s, self._after_s, self._log = keep, idle_s, after_s, log
        self._lock = threading.RLock()  # who uses the consumer: the loop (nested holds pass) or the keeper
        self._lent = threading.Event()
        self._wanted = threading.Event()  # the loop waits for the consumer
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._loans = 0  # loans so far (lent() calls)
        self._given_up = -1  # the loan whose transaction ran too long to keep (see keep)
        self.sessions = 0

    def start(self) -> None:
        if self._thread is not None:
            return
        self._closing.clear()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (after its session, which a lent consumer's return already ended)."""
        self._closing.set()
        self._lent.set()  # wakes an idle keeper
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._lent.clear()

    @contextmanager
    def lent(self) -> Iterator[None]:
        """The loop lends the consumer while the block runs; when it ends, the keeper has
        handed it back and will not take it again before the next loan."""
        self._loans += 1
        self._lent.set()
        try:
            yield
        finally:
            self._lent.clear()
            with self.held():
                pass

    @contextmanager
    def held(self) -> Iterator[None]:
        """The loop uses the consumer in the block: a keeper polling hands it back first."""
        if not self._lock.acquire(blocking=False):  # the keeper has it (after each transaction: free)
            self._wanted.set()
            self._lock.acquire()
            self._wanted.clear()
        try:
            yield
        finally:
            self._lock.release()

    def handing_back(self) -> bool:
        """True when the keeper's session is to end (``keep``'s condition)."""
        return self._wanted.is_set() or not self._lent.is_set() or self._closing.is_set()

    def _run(self) -> None:
        while not self._closing.is_set():
            self._lent.wait()
            due_in_s = self._after_s - self._idle_s()
            if self._given_up == self._loans:  # gave up beside this loan's transaction
                self._closing.wait(LOOK_EVERY_S)
                continue
            if due_in_s > 0:
                self._closing.wait(min(due_in_s, LOOK_EVERY_S))
                continue
            if not self._lock.acquire(timeout=LOOK_EVERY_S):
                continue  # the loop uses it (and polls, or will hand it back soon)
            try:
                # Checked again with the consumer in hand: the loop may have polled, or want it.
                if not self.handing_back() and self._idle_s() >= self._after_s:
                    self.sessions += 1
                    if self._keep(self.handing_back):  # given up: the member leaves, as before
                        self._given_up = self._loans  # not kept again before the next loan
            except Exception as exc:  # noqa: BLE001 - the loop goes on; the member may leave, as before
                self._log.error("kafka_keeper_failed", error=str(exc), error_type=type(exc).__name__,
                                hint="the consumer stops polling Kafka inside long transactions: one longer "
                                     "than max.poll.interval.ms makes this member leave its group")
                self._closing.set()
            finally:
                self._lock.release()
            # A session ends when the loop wants the consumer: let it take the lock first.
            self._closing.wait(0.01)
