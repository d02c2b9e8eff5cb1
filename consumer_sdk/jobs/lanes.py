"""The dispatcher's view of the ready lanes: what a round claims, and which owners come next.

Listing the (queue, owner) lanes with ready work is the costliest statement of a round, so
the dispatcher plans from the lanes it last read for at most ``ttl_s`` while its own claims
account for what changed (:func:`~consumer_sdk.jobs.fairness.after_round`); a wake-up, a
retry falling due or a claim that got less than planned reads them again.

A read lists at most ``max_owners`` owners per queue (``max_owners_per_round``).  The
list starts after the owner this pool served last in that queue, in the order of the
last list, and wraps around (:func:`~consumer_sdk.jobs.claims.ready_lanes`); the plan deals
the slots to the least recently served lanes first, in that order among equals.  A list
that was cut (``max_owners`` owners listed: there may be more) is read again as soon as
each of its owners got a job: one turn, then the next owners.  So the owners are served
in turn whatever their number: an owner with ready work is listed within
ceil(owners / max_owners) reads and waits for about one job of each owner before it, not
for their work to run out (cut in owner_id order, and planned from while the cache
lasted, a tenant behind 520 others started after 5,119 of their 5,200 jobs: an audit of
the pool).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from consumer_sdk.jobs import claims
from consumer_sdk.jobs.fairness import Limits, RoundRobin, after_round, plan
from consumer_sdk.jobs.model import ClaimedJob, Lane, Take


class Lanes:
    """The lanes a dispatcher plans from, its round-robin memory and each queue's cursor."""

    def __init__(self, *, queues: Sequence[str], max_owners: int, ttl_s: float, clock: Callable[[], float],
                 db_now: Callable[[], datetime | None]) -> None:
        self.queues = list(queues)
        self.max_owners = max_owners
        self.ttl_s = ttl_s
        self._clock = clock
        self._db_now = db_now
        #: Set when the lanes must be read again at the next round (new work, a retry due).
        self.stale = threading.Event()
        self.rr = RoundRobin()
        #: Per queue, the owner served last in the order of the lanes read: the next read
        #: starts after it.
        self.after: dict[str, str] = {}
        self.reads = 0  # lists read from the database (tests count them)
        self._lanes: list[Lane] = []
        self._until = 0.0
        #: Per queue whose list was cut: its owners not served since it was read.
        self._turn: dict[str, set[str]] = {}

    def current(self, conn: Any) -> list[Lane]:
        """The ready lanes, read again when stale, none are left, or ``ttl_s`` passed."""
        now = self._clock()
        if self.stale.is_set() or not self._lanes or now >= self._until:
            self.stale.clear()
            self._lanes = claims.ready_lanes(conn, queues=self.queues, max_owners=self.max_owners,
                                             now=self._db_now(), after=self.after)
            self._until = now + self.ttl_s
            self.reads += 1
            listed: dict[str, set[str]] = {}
            for lane in self._lanes:
                listed.setdefault(lane.queue, set()).add(lane.owner_id)
            self._turn = {queue: owners for queue, owners in listed.items() if len(owners) >= self.max_owners}
        return self._lanes

    def plan(self, lanes: Sequence[Lane], *, busy: Mapping[str, int], limits: Limits) -> list[Take]:
        return plan(lanes, queues=self.queues, busy=busy, limits=limits, last_served=self.rr.last_served)

    def after_round(self, lanes: list[Lane], takes: list[Take], claimed: list[ClaimedJob],
                    written: Mapping[str, int], limits: Limits, sent_at: float) -> bool:
        """Record a round that claimed ``claimed`` (from ``lanes``) and completed the jobs of
        ``written`` (owner: jobs); True when an owner its limit held back has room now (see
        :func:`~consumer_sdk.jobs.fairness.after_round`)."""
        served = dict.fromkeys((job.queue, job.owner_id) for job in claimed)
        self.rr.record(served, sent_at)
        for lane in lanes if served else ():  # in the order read: the last served moves the cursor
            if (lane.queue, lane.owner_id) in served:
                self.after[lane.queue] = lane.owner_id
        for queue, owner in served:
            waiting = self._turn.get(queue)
            if waiting is not None:
                waiting.discard(owner)
                if not waiting:  # a cut list's turn is over: the next round reads the owners after it
                    del self._turn[queue]
                    self.stale.set()
        self._lanes, unblocked = after_round(lanes, takes, claimed, written, limits)
        return unblocked
