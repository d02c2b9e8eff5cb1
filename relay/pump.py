"""The loop body: claim a batch, produce it, mark what the broker acknowledged.

Batches by snapshot difference, as PgQ does: a claim takes the rows that committed
between the previous window's snapshot and its own (visible in one, not in the
other), in (xid, id) order; a window larger than a batch is continued, with the same
pair of snapshots, after a cursor inside it, so up to ``pipeline_depth`` batches are
in flight and no row is claimed twice.  A transaction still open never holds a claim
back: its rows join the window in which it commits.  So a key's rows go out in
commit order at the granularity of windows, and in (xid, id) order inside one
(commit order for writers that serialize on the key).  A shard left out of a claim
(being given back, briefly untrusted) misses that window's rows: when it comes back
the pump rewinds to "nothing seen" (every pending row of its shards) first.

Marks run on connections of their own, in background threads (relay/marker.py), while
the pump claims and produces the next batches: a batch's mark and the next claim then
cost the database's statements at once instead of one after the other.  Marks are
applied (leases lost to fencing, metrics) on the pump's thread, in batch order; a
batch awaiting its mark still counts as in flight, so no rewind claims its rows again,
and against the pipeline depth, so a crash republishes at most ``pipeline_depth``
batches.

Per-key order: the producer is idempotent, so rows of one partition reach the
broker in produce order.  When a row fails, no later row of its key is produced
in that batch, the pump stops claiming, waits for what is in flight, and rewinds
the cursor to the oldest unpublished row; a row in back-off holds its key's later
rows back in the claim query itself.  A later row of the key in its topic acknowledged
in spite of that (an earlier in-flight batch failing behind it) is counted in
``outbox_relay_order_violations_total``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol

from relay.failures import FailurePublisher, Failures, FailureStore
from relay.inflight import InFlight, PendingMark
from relay.leases import LeaseManager
from relay.mark_lanes import MarkLanes
from relay.marker import MarkStore
from relay.metrics import RelayMetrics
from relay.model import (
    START,
    BatchResult,
    Claimed,
    Cursor,
    OutboxRow,
    ShardId,
)
from relay.outcomes import Outcome
from relay.publisher import DeliveryCallback

# The claim and the settling live in relay/pump_claim.py and relay/pump_settle.py; the
# constants the tests import from here are re-exported.
from relay.pump_claim import LEASE_LOOK_ROWS as LEASE_LOOK_ROWS
from relay.pump_claim import LEASE_NEAR_S as LEASE_NEAR_S
from relay.pump_claim import PACE_STEP as PACE_STEP
from relay.pump_claim import PACED_CLAIM_ROWS as PACED_CLAIM_ROWS
from relay.pump_claim import Claiming
from relay.pump_settle import INLINE_MARK_ROWS as INLINE_MARK_ROWS
from relay.pump_settle import Settling, reopens
from relay.stalls import Stalls, StallSigns

DEFAULT_BATCH_MAX_BYTES = 4 << 20  # payload bytes per claim; 4 in flight: 16 MiB
DEFAULT_MAX_MESSAGE_BYTES = 1_000_000  # librdkafka's message.max.bytes default
SWEEP_INTERVAL_S = 10.0  # a full pass, and a look for foreign xids, at most this often when caught up
#: A sweep that cost this many seconds (the restamp and the claim from "nothing seen") puts
#: the next one at least SWEEP_COST_RATIO times as far away: sweeps take at most about 2 %
#: of the pump's time.  A session idle in transaction keeps every row marked since it
#: began in the index of pending rows (vacuum may not remove them yet), and a sweep walks
#: them all: 200,000 rows cost one about 160 ms, an hour at 1,000 events/s seconds.
SWEEP_COST_RATIO = 50.0
SWEEP_SLOW_S = 0.5  # a sweep this slow is logged (sweep_slow), with when the next one runs


class PumpStore(MarkStore, FailureStore, Protocol):
    def claim(self, *, shards: Any, nshards: int, after: Cursor, limit: int,
              max_bytes: int, budget_bytes: int, sent_retries: Iterable[int]) -> Claimed: ...
    def sweep(self, *, shards: Sequence[ShardId], nshards: int) -> tuple[int, float | None]: ...


class PumpPublisher(FailurePublisher, Protocol):
    def send(self, row: OutboxRow, on_delivery: DeliveryCallback) -> Outcome | None: ...
    def poll(self, timeout_s: float) -> int: ...
    def partition_of(self, row: OutboxRow) -> int | None: ...


class Pump(Claiming, Settling):
    """Claims, produces and marks.  ``run_once`` never blocks for long; the loop
    (relay/loop.py) decides when to claim and waits.  ``start()`` starts the mark threads."""

    def __init__(
        self,
        *,
        store: PumpStore,
        publisher: PumpPublisher,
        leases: LeaseManager,
        nshards: int,
        batch_size: int,
        pipeline_depth: int,
        max_attempts: int,
        backoff_initial_s: float,
        backoff_max_s: float,
        metrics: RelayMetrics,
        log: Any,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        dead_letter_topic: str | None = None,
        mark_store: MarkStore | Sequence[MarkStore] | None = None,
        batch_max_bytes: int = DEFAULT_BATCH_MAX_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        claim_interval_s: float = 0.0,
        claim_interval_max_s: float = 0.0,
    ) -> None:
        """``mark_store``: connections to mark on in the background, one or several
        (:class:`relay.mark_lanes.MarkLanes`; None: mark synchronously on ``store``).  ``batch_max_bytes``: payload bytes per claim (the
        row that crosses it is the last); ``max_message_bytes``: the producer's limit,
        above which a row is dead-lettered by its size, its payload never fetched.
        ``claim_interval_s``, ``claim_interval_max_s``: after a claim that caught up, the
        next one waits between these: claims paced to the arrival rate, each taking what
        committed meanwhile (:meth:`_pace`)."""
        self.claim_interval_s = claim_interval_s
        self.claim_interval_max_s = max(claim_interval_s, claim_interval_max_s)
        self.pace_s = claim_interval_s
        self.batch_max_bytes = batch_max_bytes
        self.max_message_bytes = max_message_bytes
        self.store = store
        self.publisher = publisher
        self.leases = leases
        self.nshards = nshards
        self.batch_size = batch_size
        self.pipeline_depth = pipeline_depth
        self.metrics = metrics
        self.log = log
        self.clock = clock
        self.wall_clock = wall_clock
        self.cursor: Cursor = START
        self.cursor_shards: set[ShardId] = set()  # claimed in every claim since the last rewind
        self.in_flight: deque[InFlight] = deque()
        self.marking: deque[PendingMark] = deque()
        mark_stores: list[MarkStore] = []
        if isinstance(mark_store, Sequence):
            mark_stores.extend(mark_store)
        elif mark_store is not None:
            mark_stores.append(mark_store)
        self._marker = MarkLanes(mark_stores, leases.owner, log=log, on_cancel=lambda connection: (
            metrics.mark_statements_cancelled.labels(connection).inc())) if mark_stores else None
        # What a mark on this thread runs on: the first mark connection (or the store).
        self._inline_store: MarkStore = self._marker.store if self._marker else store
        self._inline_reopens = reopens(self._inline_store)
        self.rewind_requested = True  # the first claim starts from "nothing seen"
        self.caught_up = False
        self.claim_not_before = 0.0
        self.backoff_until = 0.0  # the part of claim_not_before that is a back-off, not a pace
        self.next_sweep = clock() + SWEEP_INTERVAL_S
        self._rewind_cost_s: float | None = None  # the last rewind's restamp, until its claim
        #: (topic, key) of the rows that failed since the last rewind.  Per-key order is a
        #: key's order in each topic (README "Ordering"): Kafka orders a partition, and a
        #: key's rows in two topics are produced side by side to two partitions.
        self.failed_keys: set[tuple[str, str]] = set()
        #: Rows in back-off (a failed attempt before) sent since the last rewind, until
        #: marked: the claim no longer holds their keys' later rows for them.
        self.sent_retries: set[int] = set()
        self.failures = Failures(store=store, publisher=publisher, leases=leases, metrics=metrics,
                                 log=log, clock=clock, max_attempts=max_attempts,
                                 backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
                                 dead_letter_topic=dead_letter_topic)
        # The exactly-once publisher says which waiting rows their partition holds up and which
        # partitions have no leader (relay/stalls.py); the default one has neither.
        signs = publisher if isinstance(publisher, StallSigns) else None
        self.stalls = Stalls(partition_of=publisher.partition_of,
                             undelivered=signs.undelivered if signs is not None else None,
                             leaderless=signs.leaderless if signs is not None else None)
        # Publishers that can wait for every outstanding report in one call (not the
        # exactly-once one, whose reports come from its shard workers).
        self._wait_reports: Callable[[float], int] | None = getattr(publisher, "wait_reports", None)
        self.draining = False
        self.last_marked_at = clock()
        self.totals = BatchResult()
        self._carried = BatchResult()  # settled inside wait(), reported by the next run_once

    # -- state ----------------------------------------------------------------------------

    def busy_shards(self) -> set[ShardId]:
        busy: set[ShardId] = set()
        for batch in self.in_flight:
            busy |= batch.shards()
        for pending in self.marking:
            busy |= {row.shard for row in pending.acked}
        return busy

    def marks_cancelled(self) -> bool:
        """Are marks the server cancelled being marked again (a lock on outbox rows, a
        ``statement_timeout``: relay/mark_cancels.py)?  Not a wedged relay (relay/probes.py)."""
        return self._marker is not None and self._marker.cancelling()

    def busy(self) -> bool:
        """Rows produced and not yet acknowledged, or acknowledged and not yet marked."""
        return bool(self.in_flight or self.marking)

    def rows_in_flight(self) -> int:
        return (sum(batch.waiting for batch in self.in_flight)
                + sum(len(pending.acked) for pending in self.marking))

    def request_rewind(self) -> None:
        self.rewind_requested = True

    def expect_new_rows(self) -> None:
        """Rows may have committed since the last claim found the backlog drained (a
        notification, or the race with the wake-up lock): the next claim looks again, and
        at once: the pace (:meth:`_pace`) spaces claims that would find a few rows each, and
        a sleeping relay's notification says there are some.  A back-off stays."""
        self.caught_up = False
        self.claim_not_before = self.backoff_until

    def idle(self) -> bool:
        """Nothing in flight and the last claim found the backlog drained."""
        return not self.busy() and (self.caught_up or not self.leases.leases)

    # -- one step -------------------------------------------------------------------------

    def run_once(self, *, claim: bool = True) -> BatchResult:
        """Settle finished batches, then (when ``claim``) claim and produce one more."""
        result, self._carried = self._carried, BatchResult()
        self.publisher.poll(0)
        now = self.clock()
        self._track_stalls(now)
        self._settle_done(result, now)
        self._collect_marks(result)
        failures = self.failures
        due_retry = failures.retry_wakeup is not None and now >= failures.retry_wakeup
        if not self._active(now):
            due_sweep = self.caught_up and now >= self.next_sweep and not self.stalls.partitions
            if self.rewind_requested or due_retry or due_sweep:
                if due_retry:
                    failures.retry_wakeup = None
                self._rewind(now)
        elif due_retry:
            # Only a rewind sends a due row, and its key's later rows wait for it: stop
            # claiming until what is in flight is settled, rather than until a backlog ends.
            self.rewind_requested = True
        if claim and not self.draining and self._may_claim(now):
            self._claim_and_send(result, now)
        self.metrics.in_flight.set(self.rows_in_flight())
        self.totals.add(result)
        return result

    def wait(self, timeout_s: float) -> None:
        """Serve delivery reports while rows are in flight, or wait for the oldest mark
        when every produced row is reported.  Returns on the first of them while a claim
        is due (the loop claims again as soon as the pipeline has room); while the next
        claim is paced (:meth:`_pace`), settles batches and applies marks here until
        ``timeout_s``, so a paced claim costs one turn of the loop, not one per report.
        Paced, with no mark running, it waits for every report in one call to the
        publisher (``wait_reports``) rather than one per broker response."""
        deadline = self.clock() + max(0.0, timeout_s)
        wait_reports = self._wait_reports
        while True:
            remaining = max(0.0, deadline - self.clock())
            if self.marking and all(batch.done for batch in self.in_flight):
                wait_futures([self.marking[0].future], timeout=remaining)
            elif self.in_flight or self.marking:
                paced_s = self.claim_not_before - self.clock()
                if (wait_reports is not None and paced_s > 0 and not self.marking
                        and not self.stalls.partitions):
                    wait_reports(min(remaining, paced_s))
                else:
                    self.publisher.poll(remaining)
            else:
                return
            now = self.clock()
            if now >= deadline or now >= self.claim_not_before or self.stalls.partitions:
                return
            self._settle_done(self._carried, now)
            self._collect_marks(self._carried)

    def start(self) -> None:
        """Start the mark threads (with a ``mark_store``).  Idempotent."""
        if self._marker is not None:
            self._marker.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the mark threads (after the marks already submitted).  Idempotent."""
        if self._marker is not None:
            self._marker.stop(timeout_s)

    def _rewind(self, now: float) -> None:
        """Back to "nothing seen": the next claim takes every pending row of the shards.

        Only with nothing in flight.  Besides the rewinds that failures, retries and
        shard changes ask for, one runs every ``SWEEP_INTERVAL_S`` while caught up: it
        finds rows that no window holds (rows in back-off whose retry another replica
        scheduled, rows restored with an old xid of another cluster), and first gives
        rows with a foreign xid one of this cluster's (so the pass cannot take them in
        another cluster's xid order).
        """
        self.cursor = START
        self.rewind_requested = False
        self.failed_keys.clear()
        self.sent_retries.clear()
        self.failures.keep_shards(self.leases.leases)
        rewound = getattr(self.publisher, "rewound", None)  # exactly-once: failed shards resume
        if rewound is not None:
            rewound()
        if not self.stalls.partitions:
            self.stalls.held.clear()  # their rows come back in this rewind, in order
        self.next_sweep = now + SWEEP_INTERVAL_S
        # One statement: rows with a foreign xid restamped, and when a row another replica (or
        # this relay before a restart) put in back-off is due: sent at its retry time, as this
        # relay's own are, not at the next periodic pass.
        self.statement = "sweep"  # cancelled: the loop asks the rewind again (the cursor is at START)
        restamped, due_in = self.store.sweep(shards=sorted(self.leases.leases), nshards=self.nshards)
        self.statement = "other"
        if due_in is not None and self.leases.leases:
            self.failures.wake_at(now + max(0.0, due_in))
        self._rewind_cost_s = self.clock() - now  # the claim from "nothing seen" adds its own
        if restamped:
            self.log.warning("foreign_xids_restamped", rows=restamped)

    def _sweep_cost(self, cost_s: float) -> None:
        """After a rewind's claim: a rewind as costly as ``cost_s`` (restamp and claim) puts
        the next periodic sweep at least ``SWEEP_COST_RATIO`` times as far away."""
        self._rewind_cost_s = None
        spaced_s = SWEEP_COST_RATIO * cost_s
        if spaced_s > SWEEP_INTERVAL_S:
            self.next_sweep = max(self.next_sweep, self.clock() + spaced_s)
        if cost_s >= SWEEP_SLOW_S:
            self.log.warning("sweep_slow", seconds=round(cost_s, 3), next_sweep_in_s=round(spaced_s, 1),
                             hint="a session idle in transaction (pg_stat_activity) keeps marked rows "
                                  "in the pending index until it ends")

    def _active_batches(self, now: float) -> int:
        """Batches in flight that are not stalled: they count against the pipeline depth."""
        return sum(1 for batch in self.in_flight if not self.stalls.stalled(batch, now))

    def _active(self, now: float) -> bool:
        """Rows in flight that a rewind could claim twice: batches not stalled, or marks.
        (A stalled batch's rows wait on their partition; a rewind skips their keys.)"""
        return bool(self.marking) or self._active_batches(now) > 0

    def _track_stalls(self, now: float) -> None:
        if not self.in_flight and not self.stalls.partitions:
            return
        before = self.stalls.named  # said: relay.stalls names no partition the metadata clears
        if self.stalls.update(self.in_flight, now):
            self.log.info("partitions_acknowledge_again", held_keys=len(self.stalls.held))
            if self.stalls.rewind_after:  # the rows skipped meanwhile
                self.stalls.rewind_after = False
                self.request_rewind()
        for (topic, partition), waiting in self.stalls.named.items():
            if (topic, partition) not in before:
                self.log.warning("partition_stalled", topic=topic, partition=partition,
                                 rows_waiting=waiting)
        self._gauge_stalls(before)


    # -- shutdown -------------------------------------------------------------------------

    def drain(self, timeout_s: float) -> BatchResult:
        """Stop claiming; wait up to ``timeout_s`` for in-flight reports; mark what was acked."""
        self.draining = True
        result, self._carried = self._carried, BatchResult()
        deadline = self.clock() + timeout_s
        while self.in_flight and self.clock() < deadline:
            self.publisher.poll(min(0.1, max(0.0, deadline - self.clock())))
            self._settle_done(result, self.clock())
        # Whatever is still unreported stays pending and will be published again.
        while self.in_flight:
            batch = self.in_flight.popleft()
            acked = [row for row in batch.rows if batch.outcomes.get(row.id, Outcome(ok=False)).ok]
            if acked:
                self._mark(batch, acked)
        # A mark stuck on an unreachable database is left behind: its rows stay pending.
        wait_futures([pending.future for pending in self.marking],
                     timeout=max(1.0, deadline - self.clock()))
        self._collect_marks(result)
        self.totals.add(result)
        return result
