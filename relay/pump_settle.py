"""The settling side of the pump: finished batches settled in order, their rows marked.

:class:`Settling` is a part of :class:`relay.pump.Pump` (the module docstring there tells
the whole loop): a batch whose reports are all in is settled in production order (a
stalled one does not hold back the next), its failures handed to relay/failures.py, its
acknowledged rows marked (in the background, relay/marker.py, or at once), and finished
marks applied in batch order (leases lost to fencing, metrics).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from relay.failures import Failures
from relay.inflight import InFlight, PendingMark
from relay.leases import LeaseManager
from relay.mark_lanes import MarkLanes
from relay.marker import MarkCancelled, MarkOutcome, MarkStore, mark_rows
from relay.metric_labels import OTHER_TOPICS
from relay.metrics import RelayMetrics, observe_many
from relay.model import BatchResult, OutboxRow
from relay.stalls import Partition, Stalls

if TYPE_CHECKING:
    from relay.pump import PumpPublisher, PumpStore

INLINE_MARK_ROWS = 64  # a drained window's batch up to this size is marked on the pump's thread


@runtime_checkable
class Reopens(Protocol):
    """A mark store that says when its connection must be re-opened before its next
    statement (relay.reopening.CheckedStore): a re-open may wait (a pooler's queue)."""

    needs_reopen: bool


class _NeverReopens:
    """Any other mark store's stand-in in the pump's test: no re-open it waits for."""

    needs_reopen = False


def reopens(store: object) -> Reopens:
    """``store``, when it says whether its connection must be re-opened; else a stand-in."""
    return store if isinstance(store, Reopens) else _NeverReopens()


CREATED, TOPIC, _SHARD, _ID = (attrgetter("created_epoch"), attrgetter("topic"), attrgetter("shard"),
                             attrgetter("id"))


class Settling:
    """Settles and marks for :class:`relay.pump.Pump`, whose state it works on."""

    if TYPE_CHECKING:  # the pump's state and methods (relay/pump.py)
        store: PumpStore
        publisher: PumpPublisher
        leases: LeaseManager
        metrics: RelayMetrics
        log: Any
        clock: Callable[[], float]
        wall_clock: Callable[[], float]
        in_flight: deque[InFlight]
        marking: deque[PendingMark]
        failures: Failures
        stalls: Stalls
        failed_keys: set[tuple[str, str]]
        sent_retries: set[int]
        caught_up: bool
        claim_not_before: float
        backoff_until: float
        last_marked_at: float
        _marker: MarkLanes | None
        _inline_store: MarkStore
        _inline_reopens: Reopens

        def request_rewind(self) -> None: ...

    def _settle_done(self, result: BatchResult, now: float) -> None:
        """Settle finished batches in production order; a batch stalled on a partition
        does not hold back the ones after it, and what it got acknowledged is marked."""
        if not self.stalls.partitions:
            while self.in_flight and self.in_flight[0].done:
                self._settle(self.in_flight.popleft(), result)
            return
        kept: deque[InFlight] = deque()
        for batch in self.in_flight:
            if batch.done:
                self._settle(batch, result)
                continue
            if self.stalls.stalled(batch, now):
                acked = [row for row in batch.rows
                         if row.id in batch.outcomes and batch.outcomes[row.id].ok]
                if acked:
                    result.acked += len(acked)
                    self._mark(batch, acked)
                    done = {row.id for row in acked}
                    batch.rows = [row for row in batch.rows if row.id not in done]
            kept.append(batch)
        self.in_flight = kept

    def _settle(self, batch: InFlight, result: BatchResult) -> None:
        failures = self.failures
        if failures.isolated:
            for row in batch.rows:
                if row.id in failures.isolated and batch.outcomes[row.id].ok:
                    failures.cleared(row.id)
        if not batch.failures and not self.failed_keys:  # every row delivered: no look at each
            result.acked += len(batch.rows)
            if batch.rows:
                self._mark(batch, batch.rows)
            failures.transient_streak = 0
            return
        acked: list[OutboxRow] = []
        failed: list[OutboxRow] = []
        for row in batch.rows:
            outcome = batch.outcomes[row.id]
            if outcome.ok:
                if row.key is not None and (row.topic, row.key) in self.failed_keys:
                    result.order_violations += 1
                    self.metrics.order_violations.inc()
                    self.log.error("order_violation", shard=row.shard, row_id=row.id)
                acked.append(row)
            else:
                failed.append(row)
                if row.key is not None:
                    self.failed_keys.add((row.topic, row.key))
        result.acked += len(acked)
        if acked:
            self._mark(batch, acked)
        if failed:
            self.request_rewind()
            not_before = failures.handle(batch, failed, result)
            if not_before is not None:
                self.claim_not_before = self.backoff_until = not_before
        else:
            failures.transient_streak = 0

    def _mark(self, batch: InFlight, acked: list[OutboxRow]) -> None:
        """Mark ``acked`` in the background, or at once on this thread: without a mark
        store, or when nothing could run meanwhile (a small batch of a drained window,
        nothing else in flight or marking: the next claim is paced).  Handing such a
        mark to the mark thread and waiting for it costs two thread wake-ups for no
        overlap.  Not when the mark store's connection must be re-opened first
        (``needs_reopen``, relay.reopening.CheckedStore): behind a session pooler with
        no server free the re-open waits, and this thread (heartbeats, claims) waited
        with it; the mark thread waits instead.  Either way a failed mark raises in
        :meth:`_collect_marks`."""
        marker = self._marker
        if marker is not None and not (self.caught_up and len(acked) <= INLINE_MARK_ROWS
                                       and not self.in_flight and not self.marking
                                       and not self._inline_reopens.needs_reopen
                                       and not marker.lanes[0].cancels.in_a_row):
            future = marker.submit(batch.tokens, acked)
        else:
            future = Future()
            shards = set(map(_SHARD, acked))  # fenced by its rows' shards only, as the mark threads' parts are
            tokens = {shard: token for shard, token in batch.tokens.items() if shard in shards}
            try:  # the mark threads are idle: nothing is marking
                future.set_result(mark_rows(self._inline_store, self.leases.owner, tokens, acked))
            except MarkCancelled as exc:
                if marker is None:  # marked on the claims connection: the loop rewinds
                    future.set_exception(exc)
                else:  # nothing of it committed: marked again by the mark thread, after a back-off
                    marker.cancelled(exc)
                    future = marker.submit(batch.tokens, acked)
            except Exception as exc:  # like the mark thread's: raised in _collect_marks
                future.set_exception(exc)
        self.marking.append(PendingMark(batch, acked, future))

    def _collect_marks(self, result: BatchResult) -> None:
        """Apply finished marks in batch order.  A failed mark raises its error here,
        after leaving the queue: its rows stay pending and are claimed again."""
        while self.marking and self.marking[0].future.done():
            pending = self.marking.popleft()
            self._apply_mark(pending, pending.future.result(), result)

    def _apply_mark(self, pending: PendingMark, outcome: MarkOutcome, result: BatchResult) -> None:
        acked = pending.acked
        held, marked, took = outcome
        self.metrics.mark_duration.observe(took)
        lost = {row.shard for row in acked} - held
        if lost:
            fenced = sum(1 for row in acked if row.shard in lost)
            result.fenced += fenced
            self.metrics.fenced_writes.inc(fenced)
            self.leases.lose(lost, "mark_fenced")
        result.marked += len(marked)
        confirm = getattr(self.publisher, "confirm_marked", None)  # exactly-once positions
        if confirm is not None:
            confirm(row.id for row in acked if row.shard in held)
        if marked:
            self.last_marked_at = self.clock()
            self.metrics.last_publish.set(self.wall_clock())
        now_wall = self.wall_clock()
        done = acked if len(marked) == len(acked) else [row for row in acked if row.id in marked]
        if self.sent_retries:  # marked: no longer in back-off
            self.sent_retries.difference_update(map(_ID, done))
        latencies = [now_wall - epoch for epoch in map(CREATED, done)]
        if latencies and not 0.0 <= min(latencies) <= max(latencies) < math.inf:
            # A writer's clock ahead of this one (below 0), or a created_at of ±infinity (the
            # schema allows it): one infinite observation kept the histogram's sum at +Inf for
            # the process's life, and every mean latency after it NaN (an audit's finding).
            latencies = [max(0.0, latency) for latency in latencies if math.isfinite(latency)]
        observe_many(self.metrics.commit_to_ack, latencies)
        for topic, count in Counter(map(TOPIC, done)).items():
            self.metrics.published.labels(self._topic_label(topic)).inc(count)

    def _gauge_stalls(self, before: Mapping[Partition, int]) -> None:
        """outbox_relay_stalled_rows of the partitions stalled now, by their topics' labels
        (topics past the bound share a series per partition, their rows summed); those of
        ``before`` no longer stalled removed."""
        gauged: dict[tuple[str, str], int] = {}
        for (topic, partition), waiting in self.stalls.named.items():
            series = (self._topic_label(topic), str(partition))
            gauged[series] = gauged.get(series, 0) + waiting
        for (label, number), waiting in gauged.items():
            self.metrics.stalled_rows.labels(label, number).set(waiting)
        for label, number in {(self._topic_label(topic), str(partition))
                              for topic, partition in before} - gauged.keys():
            self.metrics.stalled_rows.remove(label, number)

    def _topic_label(self, topic: str) -> str:
        """The label ``topic`` is counted under in the metrics (relay/metric_labels.py): past
        ``--metrics-max-topics`` topics, ``_other``, said once; log lines keep the topic."""
        topics = self.metrics.topics
        label = topics.label(topic)
        if label is OTHER_TOPICS and not topics.folding_said:
            topics.folding_said = True
            self.log.warning("metrics_topics_folded", max_topics=topics.max_topics, topic=topic,
                             label=OTHER_TOPICS,
                             detail=f"{topics.max_topics} topics have a series of their own; rows "
                                    f"of later topics are counted under topic=\"{OTHER_TOPICS}\" "
                                    "(raise --metrics-max-topics / "
                                    "OUTBOX_RELAY_METRICS_MAX_TOPICS for more)")
        return label
