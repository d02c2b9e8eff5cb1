"""Exactly-once mode (issue 20): Kafka transactions fenced by the shard leases.

:class:`TransactionalPublisher` implements the pump's ``PumpPublisher`` protocol, so the
pump's claim, settle, mark and rewind logic is the default mode's.  What changes:

- Each held shard has a transactional producer (``transactional.id`` =
  ``<prefix><table>.<shard>``), on a worker thread (relay/exactly_once_shard.py),
  created when the lease is acquired: ``init_transactions`` fences the previous
  holder's producer (its open transaction is aborted, its later commits fail).
- ``send`` only buffers a row for its shard; ``poll`` starts, for every shard whose
  worker is idle and whose last transaction started ``commit_interval_s`` ago or more (or
  whose buffer holds ``FULL_TRANSACTION_ROWS``), one transaction with the rows buffered:
  the rows, then ONE position
  record to the relay's compacted position topic (partition = shard) listing the ids
  of this transaction and of the shard's earlier committed transactions whose marks
  are not confirmed yet (written in parts when over the topic's max.message.bytes:
  relay/exactly_once_records.py); then commit.  Outcomes come back through a queue and the
  pump's callbacks run inside ``poll``, on the pump's thread.
- A failed transaction fails its rows and every row buffered after it for the shard,
  and the shard produces nothing more until the pump rewinds (per-key order).
  A fenced one also loses the lease, but not one that outlived ``transaction.timeout.ms``
  (the broker aborted it, bumping the epoch) while the lease is trusted: a new producer
  recovers in place (giving the lease up idled a lone replica's shard until its next
  heartbeat).  Trusted, the database lease has not expired: nobody took the shard (the
  recovery's mark is fenced by the token all the same).  The aborted transaction's
  position record is aborted too: the recovery reads the last committed one, which lists
  every row committed and not confirmed marked, as a new holder's would.
- Recovery: before a new (or re-created) producer's shard may be claimed
  (``ready``), the worker reads the shard's last committed position record back
  (``read_committed``) and marks the rows it lists as published, fenced with the
  current token.  So a crash between a commit and its mark republishes nothing.
- A row claimed again while its id is known committed (a mark lost to a database
  error) is acknowledged without being produced again.

Dead letters and replays go through the plain idempotent producer (not transactional).
A batch settles only when the transactions of all its shards have committed, so this
mode keeps more batches in flight: ``--exactly-once-pipeline-depth`` (16; see README).

The pump's side, ``send``'s buffers, ``poll``'s transactions and the pump's hooks, is
relay/exactly_once_buffers.py (:class:`BufferingPublisher`); this module keeps the shards'
workers in step with the leases and applies their results.
"""

from __future__ import annotations

from relay.errors import ConfigError, LeaseLost
from relay.exactly_once_buffers import FULL_TRANSACTION_ROWS as FULL_TRANSACTION_ROWS
from relay.exactly_once_buffers import BufferingPublisher, ShardState
from relay.exactly_once_position import BrokerUnreachable, ensure_position_topic, mark_listed
from relay.exactly_once_records import (
    RECORD_OVERHEAD_BYTES,
    PositionTopicTooSmall,
    smallest_limit_bytes,
)
from relay.exactly_once_shard import Result, ShardWorker
from relay.model import Lease, RowId, ShardId, Token

INIT_RETRY_INITIAL_S = 0.5
INIT_RETRY_MAX_S = 10.0
POSITION_RECREATE_EVERY_S = 5.0  # a deleted position topic is created again at most this often


class TransactionalPublisher(BufferingPublisher):
    """The pump's publisher in exactly-once mode.  Driven by the pump's thread only.  What
    the pump calls, and the buffers it fills, are :class:`BufferingPublisher`'s
    (relay/exactly_once_buffers.py); here, the shards' workers follow the leases, and
    their results (init, recovery, a transaction's end, a fence) change the shards' state."""

    @staticmethod
    def prepare(config: dict[str, str], position_topic: str, nshards: int) -> int:
        """At start: the position topic exists with a partition per shard (or ConfigError).
        Its position records' largest size, for the publisher's ``record_limit_bytes``."""
        return ensure_position_topic(config, position_topic, nshards).record_limit_bytes

    def transactional_id(self, shard: ShardId) -> str:
        return f"{self._prefix}{self._table}.{shard}"

    # -- the shards' workers --------------------------------------------------------------

    def _recover(self, shard: ShardId, token: Token, ids: list[RowId], events: list[int] | None) -> None:
        """On a worker's thread: mark what the last committed position lists, fenced
        (relay.exactly_once_position.mark_listed)."""
        with self._store_lock:
            held, marked, found = mark_listed(self._store, self._leases.owner, Lease(shard, token, 0.0), ids, events)
        if shard not in held:
            raise LeaseLost(f"shard {shard}: lease taken over during recovery")
        self._log.info("exactly_once_recovered", shard=shard, listed=len(ids), marked=marked,
                       other_events=max(0, len(ids) - found))

    def _sync_leases(self) -> None:
        held = {shard: lease.token for shard, lease in self._leases.leases.items()}
        for shard, state in list(self._shards.items()):
            if held.get(shard) != state.worker.token:
                self._close_shard(shard, "lease_gone")
        now = self._clock()
        for shard, token in held.items():
            if shard in self._shards or now < self._retry.get(shard, (0.0, 0.0))[0]:
                continue
            self._shards[shard] = ShardState(ShardWorker(
                shard, token, config=self._config, transactional_id=self.transactional_id(shard),
                position_topic=self._position_topic, recover=self._recover, results=self._results,
                outbox=self._outbox, sent=self._sent))

    def _apply(self, result: Result) -> int:
        worker = result.worker
        state = self._shards.get(worker.shard)
        current = state is not None and state.worker is worker
        if result.init:
            return self._apply_init(result, state if current else None)
        if current and state is not None:
            state.running = False
        self._sent.forget(result.rows, worker)
        # Open past transaction.timeout.ms, it was the broker's timeout that aborted it and
        # fenced its producer (librdkafka: "fenced by a newer instance"), not another owner:
        # a lone replica paused past it said it was fenced.
        fenced = result.fenced and not result.timed_out
        if self._metrics is not None:
            outcome = "committed" if result.ok else ("fenced" if fenced else "aborted")
            self._metrics.transactions.labels(outcome).inc()
        if result.position_refused:
            self._cut_position_records(max(result.position_refused))
        if result.ok and current and state is not None:
            state.unconfirmed.update((row.id, result.listed[row.id]) for row in result.rows)
        elif not result.ok:
            self._log.warning("transaction_failed", shard=worker.shard, rows=len(result.rows),
                              fenced=fenced, timed_out=result.timed_out, error=result.error)
            if current and state is not None:
                state.poisoned = True
                self._fail_buffer(state, "earlier_transaction_failed")
                if result.broken:
                    self._close_shard(worker.shard, "producer_replaced")
                    self._retry[worker.shard] = (self._clock() + INIT_RETRY_INITIAL_S, 0.0)
            if result.fenced:
                self._after_fenced(worker, result.timed_out)
        for row in result.rows:
            result.callbacks[row.id](row, result.outcomes[row.id])
        return len(result.rows) + self._serve_immediate()

    def _apply_init(self, result: Result, state: ShardState | None) -> int:
        shard = result.worker.shard
        if state is None:
            return 0  # a worker already closed: its lease is gone
        if result.ok:
            state.ready = True
            self._retry.pop(shard, None)
            self._log.info("exactly_once_shard_ready", shard=shard,
                           transactional_id=self.transactional_id(shard))
            return 1
        if result.foreign:  # retrying would fence the other outbox's producer again and again
            self._log.error("exactly_once_foreign_position", shard=shard, error=result.error)
            self._close_shard(shard, "producer_replaced")
            self._retry[shard] = (float("inf"), 0.0)
            if self._on_fatal is not None:
                self._on_fatal(result.error)
            return 0
        if result.position_missing:
            self._recreate_position_topic()
        _, last = self._retry.get(shard, (0.0, 0.0))
        wait = min(INIT_RETRY_MAX_S, max(INIT_RETRY_INITIAL_S, last * 2))
        self._retry[shard] = (self._clock() + wait, wait)
        self._log.warning("exactly_once_shard_init_failed", shard=shard, fenced=result.fenced,
                          error=result.error, retry_in_s=wait)
        self._close_shard(shard, "producer_replaced")
        if result.fenced:
            self._lose(result.worker)
        return 0

    def _cut_position_records(self, refused_bytes: int) -> None:
        """The broker refused a position record as too large: the topic's (or the broker's)
        limit was lowered since start.  The next records are cut to half the size, not
        retried as they were (its transaction's rows were, into the same record, for ever);
        said once per cut.  Not even a record of one row fits: the relay stops (ConfigError)."""
        if refused_bytes + RECORD_OVERHEAD_BYTES > self._record_limit:
            return  # encoded before an earlier cut: the next ones are smaller already
        floor = smallest_limit_bytes(self._outbox)
        if self._record_limit <= floor:
            if self._on_fatal is not None:
                self._on_fatal(f"exactly-once: the position topic {self._position_topic} refused position "
                               f"records cut to the size of one row ({refused_bytes} bytes) as too large; "
                               f"raise its max.message.bytes (and the broker's message.max.bytes) to 1000000")
            return
        limit = max(floor, min(self._record_limit, refused_bytes + RECORD_OVERHEAD_BYTES) // 2)
        self._log.warning("exactly_once_position_record_too_large", topic=self._position_topic,
                          refused_bytes=refused_bytes, limit_bytes=limit,
                          hint=f"the broker refused a position record as too large: {self._position_topic}'s "
                               f"max.message.bytes (or the broker's message.max.bytes) is below what it was "
                               f"at start; the next records are written in parts of at most {limit} bytes. "
                               f"Restore the limit, or restart the relay to read it again")
        self._record_limit = limit

    def _recreate_position_topic(self) -> None:
        """A position partition not found: a topic deleted meanwhile is created again (every 5 s at
        most) and said so; not one whose partition has no leader (said missing until an audit).
        A topic that takes no position record of one row stops the relay, as at start (created
        again that small, it was logged "not created" until an audit, and the relay went on
        failing every transaction until its records were cut to one row)."""
        now = self._clock()
        if now < self._recreate_after or not self._nshards:
            return
        self._recreate_after = now + POSITION_RECREATE_EVERY_S
        try:
            found = ensure_position_topic(self._config, self._position_topic, self._nshards)
        except PositionTopicTooSmall as exc:  # no position can be written: as at start, the relay stops
            if exc.created:
                self._log.error("exactly_once_position_topic_missing", topic=self._position_topic,
                                hint="created again, with a record size limit too small for a position")
            if self._on_fatal is not None:
                self._on_fatal(str(exc))
            return
        except (ConfigError, BrokerUnreachable) as exc:
            self._log.warning("exactly_once_position_topic_not_created", topic=self._position_topic, error=str(exc))
            return
        if found.created:  # a new topic, a new limit (the broker's): the next records' size
            self._record_limit = found.record_limit_bytes
            self._log.error("exactly_once_position_topic_missing", topic=self._position_topic,
                            hint="created again; rows committed to Kafka whose mark was lost since may be sent again")

    def _after_fenced(self, worker: ShardWorker, timed_out: bool) -> None:
        """A producer another holder fenced loses its lease.  One the broker fenced for its
        transaction's timeout keeps a trusted lease: its successor recovers in place."""
        if timed_out and self._leases.trusted(worker.shard, self._clock()):
            self._log.info("exactly_once_shard_recovering", shard=worker.shard, reason="kafka_transaction_timed_out",
                           detail="the lease is kept: a new producer takes the transactional id and recovers")
            return
        self._lose(worker, "kafka_transaction_timed_out" if timed_out else "kafka_producer_fenced")

    def _lose(self, worker: ShardWorker, why: str = "kafka_producer_fenced") -> None:
        """A fenced producer loses its lease, unless the shard is held again since (with
        another token: our own new producer may be what fenced the old one)."""
        lease = self._leases.leases.get(worker.shard)
        if lease is not None and lease.token == worker.token:
            self._leases.lose([worker.shard], why)
