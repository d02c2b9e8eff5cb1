"""Rows the broker did not take: retried, sent alone, recorded or dead-lettered.

The pump hands each settled batch's failed rows here (:meth:`Failures.handle`) and
rewinds after them.  A transient error (the broker away, a timeout) waits a growing
back-off before the next claim.  A record batch the broker refused as too large may
have been refused for another record in it: each of its rows becomes a *suspect*, sent
again alone (``isolated``) before the refusal counts as its own.  A permanent failure
records an attempt with its own back-off (the row, and every later row of its key,
waits), or past ``max_attempts`` moves the row, in one statement, to
``outbox_dead_letters`` with the error (produced to ``--dead-letter-topic`` first, when
set).  Every write is fenced like the mark: one that finds the shard taken over loses
its lease.  See README, "Rows that cannot be published".
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any, Protocol

from outbox_core.backoff import backoff_s
from relay.inflight import InFlight
from relay.leases import LeaseManager
from relay.metrics import RelayMetrics
from relay.model import BatchResult, Lease, OutboxRow, RowId, ShardId
from relay.outcomes import Outcome


class FailureStore(Protocol):
    def record_failure(self, *, owner: str, lease: Lease, row: OutboxRow, error: str, backoff_s: float) -> int | None: ...
    def dead_letter(self, *, owner: str, lease: Lease, row: OutboxRow, reason: str, error: str) -> bool: ...


class FailurePublisher(Protocol):
    def recreate(self) -> None: ...
    def send_dead_letter(self, row: OutboxRow, *, topic: str, reason: str, error: str,
                         attempts: int) -> str | None: ...


class Failures:
    """The pump's failed rows: suspects, back-off and dead letters.  Driven by the pump's thread."""

    def __init__(self, *, store: FailureStore, publisher: FailurePublisher, leases: LeaseManager,
                 metrics: RelayMetrics, log: Any, clock: Callable[[], float], max_attempts: int,
                 backoff_initial_s: float, backoff_max_s: float, dead_letter_topic: str | None) -> None:
        self.store = store
        self.publisher = publisher
        self.leases = leases
        self.metrics = metrics
        self.log = log
        self.clock = clock
        self.max_attempts = max_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.dead_letter_topic = dead_letter_topic
        #: Rows the broker refused as too large beside other rows (row: shard): a broker
        #: refuses a whole record batch for one record over its limit, so each is sent
        #: again alone before the refusal counts as its own (``isolated``: sent alone).
        self.suspects: dict[RowId, ShardId] = {}
        self.isolated: set[RowId] = set()
        self.transient_streak = 0  # settled batches in a row with a transient failure
        #: When the earliest row this replica put in back-off is due (a rewind finds it).
        self.retry_wakeup: float | None = None

    def handle(self, batch: InFlight, failed: list[OutboxRow], result: BatchResult) -> float | None:
        """The rows of ``batch`` the broker did not take (the pump rewinds after them).
        Returns the time (the pump's clock) before which no claim runs when one failure
        may pass by itself (a transient error, a refused record batch), else None."""
        result.failed += len(failed)
        transient = False
        recreate = False
        for row in failed:
            outcome = batch.outcomes[row.id]
            self.metrics.publish_errors.labels(outcome.error_class).inc()
            recreate = recreate or outcome.fatal
            if (outcome.error_class == "message_too_large" and not outcome.hopeless
                    and row.id not in self.isolated):
                # The broker refused the record batch the row was in: maybe for another
                # record.  Retried alone before it counts (see Pump._claim_and_send).
                self.suspects[row.id] = row.shard
                transient = True
                continue
            if not outcome.permanent:
                transient = True
                continue
            self.cleared(row.id)
            result.errors.append(f"{outcome.error_class}: {outcome.message}")
            self._permanent(batch, row, outcome, result)
        not_before = None
        if transient:
            self.transient_streak += 1
            wait = backoff_s(self.transient_streak, initial_s=self.backoff_initial_s,
                             max_s=self.backoff_max_s)
            not_before = self.clock() + wait
            self.log.warning("publish_failed", rows=len(failed), retry_in_s=round(wait, 3),
                             error=batch.outcomes[failed[0].id].message)
        if recreate:
            self.log.error("producer_recreated", reason="fatal idempotent-producer error")
            self.publisher.recreate()
        return not_before

    def wake_at(self, at: float) -> None:
        """A row in back-off is due at ``at`` (the pump's clock): the pump rewinds then, if no
        earlier retry is due first."""
        self.retry_wakeup = at if self.retry_wakeup is None else min(self.retry_wakeup, at)

    def cleared(self, row_id: RowId) -> None:
        """A suspect row's own outcome is known: it is no longer sent alone."""
        self.suspects.pop(row_id, None)
        self.isolated.discard(row_id)

    def keep_shards(self, held: Container[ShardId]) -> None:
        """At a rewind: rows of shards given away are another replica's to isolate."""
        if self.suspects:
            self.suspects = {i: shard for i, shard in self.suspects.items() if shard in held}
            self.isolated &= self.suspects.keys()

    def _permanent(self, batch: InFlight, row: OutboxRow, outcome: Outcome, result: BatchResult) -> None:
        lease = Lease(row.shard, batch.tokens[row.shard], 0.0)
        attempts = max(row.attempts + 1, self.max_attempts if outcome.hopeless else 0)
        if attempts >= self.max_attempts and self.dead_letter_topic:
            problem = self.publisher.send_dead_letter(row, topic=self.dead_letter_topic,
                                                      reason=outcome.error_class,
                                                      error=outcome.message, attempts=row.attempts + 1)
            if problem is not None:  # not moved: retried later, never in neither place
                outcome = Outcome(ok=False, error_class=outcome.error_class, message=problem,
                                  permanent=True)
                attempts = self.max_attempts - 1
        if attempts >= self.max_attempts:
            if self.store.dead_letter(owner=self.leases.owner, lease=lease, row=row,
                                      reason=outcome.error_class, error=outcome.message):
                result.dead_lettered += 1
                self.metrics.dead_lettered.labels(outcome.error_class).inc()
                self.log.error("row_dead_lettered", row_id=row.id, event_id=row.event_id,
                               topic=row.topic, reason=outcome.error_class,
                               # The attempts made, as outbox_dead_letters records them: a
                               # hopeless row's is 1, where the log said max_attempts (an audit).
                               error=outcome.message, attempts=row.attempts + 1)
            else:
                result.fenced += 1
                self.metrics.fenced_writes.inc()
                self.leases.lose([row.shard], "dead_letter_fenced")
            return
        wait = backoff_s(attempts, initial_s=self.backoff_initial_s, max_s=self.backoff_max_s)
        recorded = self.store.record_failure(owner=self.leases.owner, lease=lease, row=row,
                                             error=f"{outcome.error_class}: {outcome.message}",
                                             backoff_s=wait)
        if recorded is None:
            result.fenced += 1
            self.metrics.fenced_writes.inc()
            self.leases.lose([row.shard], "record_failure_fenced")
            return
        self.metrics.attempts.labels(outcome.error_class).inc()
        self.wake_at(self.clock() + wait)
        self.log.warning("row_failed", row_id=row.id, topic=row.topic, reason=outcome.error_class,
                         error=outcome.message, attempts=recorded, retry_in_s=round(wait, 3))
