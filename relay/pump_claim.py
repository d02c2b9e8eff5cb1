"""The claim side of the pump: when it may claim, the claim and its rows' production, the pacing.

:class:`Claiming` is a part of :class:`relay.pump.Pump` (the module docstring there tells the
whole loop): a claim takes the next window's rows, produces them in order (a key's rows
after one of them failed, a stalled partition's and a shard near its lease's end wait
for a rewind), and after a claim that drained the backlog paces the next one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from relay.failures import Failures
from relay.inflight import InFlight, PendingMark
from relay.leases import LeaseManager
from relay.metrics import RelayMetrics
from relay.model import BatchResult, Cursor, ShardId
from relay.outcomes import QUEUE_FULL, Outcome
from relay.stalls import Stalls

if TYPE_CHECKING:
    from relay.pump import PumpPublisher, PumpStore

STALLED_ROWS_MAX = 10_000  # rows waiting on stalled partitions before claims stop altogether
STALLED_CLAIM_PAUSE_S = 0.5  # a claim that found only rows held by a stall waits this long
#: A drained claim finding fewer rows stretches the wait before the next.  Each claim cycle
#: costs about the same CPU whatever it carries (1.2-1.5 ms here), so this sets the relay's
#: CPU at steady rates against its latency: at 1,000 events/s, 10 rows cost 14.6 % of a core
#: at commit -> ack p50 7.4 ms, 12 rows 11.9 % at 8.5 ms (issue 18's twentieth pass).
PACED_CLAIM_ROWS = 12
PACE_STEP = 1.5  # how much one claim stretches or shortens that wait
# Producing a batch takes milliseconds and a lease is trusted for seconds: the clock is read
# for every row only while some lease's deadline is this close, else every LEASE_LOOK_ROWS rows.
LEASE_NEAR_S = 1.0
LEASE_LOOK_ROWS = 256


class Claiming:
    """Claims and produces for :class:`relay.pump.Pump`, whose state it works on."""

    if TYPE_CHECKING:  # the pump's state and methods (relay/pump.py)
        store: PumpStore
        publisher: PumpPublisher
        leases: LeaseManager
        metrics: RelayMetrics
        clock: Callable[[], float]
        nshards: int
        batch_size: int
        pipeline_depth: int
        batch_max_bytes: int
        max_message_bytes: int
        claim_interval_s: float
        claim_interval_max_s: float
        pace_s: float
        cursor: Cursor
        cursor_shards: set[ShardId]
        in_flight: deque[InFlight]
        marking: deque[PendingMark]
        failures: Failures
        stalls: Stalls
        sent_retries: set[int]
        rewind_requested: bool
        caught_up: bool
        claim_not_before: float
        backoff_until: float
        _rewind_cost_s: float | None

        def request_rewind(self) -> None: ...
        def _sweep_cost(self, cost_s: float) -> None: ...
        def _active_batches(self, now: float) -> int: ...

    #: The statement of the pump's that runs (``claim``, ``sweep``; ``other``), for the label
    #: of one the server cancels (relay/app_run.py, ``outbox_relay_statements_cancelled_total``).
    statement = "other"

    def _may_claim(self, now: float) -> bool:
        # Batches waiting for their mark count too: a crash republishes every row
        # produced and not yet marked, and that window is ``pipeline_depth`` batches.
        return (self._active_batches(now) + len(self.marking) < self.pipeline_depth
                and sum(self.stalls.partitions.values()) < STALLED_ROWS_MAX
                and not self.rewind_requested
                and now >= self.claim_not_before)

    def _claim_and_send(self, result: BatchResult, now: float) -> None:
        usable = self.leases.usable(now)
        ready = getattr(self.publisher, "ready", None)  # exactly-once: recovered shards only
        if ready is not None:
            usable = [lease for lease in usable if ready(lease.shard)]
        if not usable:
            return
        shards = {lease.shard for lease in usable}
        if self.cursor.fresh:
            self.cursor_shards = shards
        elif not shards <= self.cursor_shards:
            # A shard left out of the claims since the cursor last started (given back,
            # briefly untrusted, or newly held) is back: the cursor has passed its
            # pending rows.  Claim it only after a rewind.
            self.request_rewind()
            return
        else:
            self.cursor_shards = shards  # one that leaves must rewind to come back
        started, claim_started = time.perf_counter(), self.clock()
        self.statement = "claim"  # cancelled, it leaves the cursor as it was
        rows, snapshot, cut = self.store.claim(
            shards=sorted(shards), nshards=self.nshards, after=self.cursor, limit=self.batch_size,
            max_bytes=self.max_message_bytes, budget_bytes=self.batch_max_bytes,
            sent_retries=self.sent_retries)
        self.statement = "other"
        self.metrics.claim_duration.observe(time.perf_counter() - started)
        if self._rewind_cost_s is not None:
            self._sweep_cost(self._rewind_cost_s + self.clock() - claim_started)
        result.claims += 1
        window = snapshot if snapshot is not None else self.cursor.cur
        self.caught_up = len(rows) < self.batch_size and not cut
        if self.caught_up:  # the window is exhausted: next, what committed after it
            self.cursor = Cursor.after_snapshot(window)
            self._pace(len(rows), now)
        else:
            self.cursor = self.cursor.advanced(rows[-1], window)
            self.pace_s = self.claim_interval_s
        if not rows:
            return
        self.metrics.batch_size.observe(len(rows))
        result.claimed += len(rows)
        batch = InFlight(tokens={lease.shard: lease.token for lease in usable},
                         produced_at=self.clock())
        # The loop below runs once per row: names bound once, checks that cannot apply
        # skipped (no stall, no failed key, no lease near its deadline), the lease
        # deadlines looked up in a dict.
        deadlines = {lease.shard: lease.deadline_monotonic for lease in usable}
        soonest = min(deadlines.values())
        near = False
        clock, stalls, send, report = self.clock, self.stalls, self.publisher.send, batch.report
        max_message_bytes, suspects = self.max_message_bytes, self.failures.suspects
        produced = batch.rows
        blocked: set[str] = set()
        deferred = held = sent = 0
        for index, row in enumerate(rows):
            if not near and not index % LEASE_LOOK_ROWS:
                near = soonest - clock() < LEASE_NEAR_S
            if (stalls.partitions or stalls.held) and stalls.holds(row):
                held += 1  # its partition or its key waits: claimed again after the stall
                continue
            if near and deadlines.get(row.shard, 0.0) <= clock():
                deferred += 1  # lease may be gone: produce nothing more from this shard
                continue
            if blocked and row.key in blocked:
                deferred += 1  # an earlier row of this key failed in this batch
                continue
            alone = bool(suspects) and row.id in suspects
            if alone and (produced or self.in_flight):
                deferred += len(rows) - index  # sent alone: first of a claim, nothing in flight
                break
            produced.append(row)
            batch.waiting += 1
            if row.size > max_message_bytes:
                immediate: Outcome | None = Outcome(
                    ok=False, error_class="message_too_large", permanent=True, hopeless=True,
                    message=f"{row.size} bytes of payload, key and headers are over the "
                            f"producer's message.max.bytes ({max_message_bytes})")
            else:
                immediate = send(row, report)
            if immediate is None:
                sent += 1
                if row.attempts:  # maybe in back-off: its key's later rows may follow it now
                    self.sent_retries.add(row.id)
                if alone:  # nothing more until its report: no record batch shares it
                    self.failures.isolated.add(row.id)
                    deferred += len(rows) - index - 1
                    break
                continue
            if immediate is QUEUE_FULL:  # nothing more fits: the rest waits for a rewind
                produced.pop()
                batch.waiting -= 1
                deferred += len(rows) - index
                self.metrics.queue_full.inc()
                break
            report(row, immediate)
            if row.key is not None:
                blocked.add(row.key)
        result.produced += sent
        if deferred:
            self.caught_up = False
            self.request_rewind()
        if held == len(rows) and self.caught_up:
            self.claim_not_before = self.backoff_until = self.clock() + STALLED_CLAIM_PAUSE_S
        if batch.rows:
            self.in_flight.append(batch)

    def _pace(self, found: int, now: float) -> None:
        """After a claim that drained the backlog: wait before the next one, longer while
        claims find fewer than ``PACED_CLAIM_ROWS`` rows, shorter as they find more.  A
        steady trickle is then claimed a few rows at a time (at 1,000 events/s about every
        12 ms, at 100 events/s every ``claim_interval_max_s``), instead of once per delivery
        report or mark; a backlog (a full claim) resets the wait to the shortest."""
        if not self.claim_interval_s:
            return
        if found < PACED_CLAIM_ROWS:
            self.pace_s = min(self.pace_s * PACE_STEP, self.claim_interval_max_s)
        else:
            self.pace_s = max(self.pace_s / PACE_STEP, self.claim_interval_s)
        self.claim_not_before = max(self.claim_not_before, now + self.pace_s)
