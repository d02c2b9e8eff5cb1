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
  are not confirmed yet; then commit.  Outcomes come back through a queue and the
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
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from relay.errors import ConfigError, LeaseLost
from relay.exactly_once_leaders import Leaders
from relay.exactly_once_position import (
    BrokerUnreachable,
    RecoveryStore,
    ensure_position_topic,
    event_digest,
    mark_listed,
)
from relay.exactly_once_shard import Headers, Job, Result, SentRows, ShardWorker
from relay.leases import LeaseManager
from relay.model import Lease, OutboxRow, RowId, ShardId, Token
from relay.outcomes import Outcome
from relay.publisher import BadRow, DeliveryCallback, Publisher, encode_headers

INIT_RETRY_INITIAL_S = 0.5
INIT_RETRY_MAX_S = 10.0
POSITION_RECREATE_EVERY_S = 5.0  # a deleted position topic is created again at most this often
MAX_ROWS_PER_TRANSACTION = 20_000
#: A shard's buffer this full starts its transaction without waiting out the commit interval:
#: a backlog is drained in transactions of this size or more, back to back.
FULL_TRANSACTION_ROWS = 1_000


@dataclass(slots=True)
class _Shard:
    worker: ShardWorker
    ready: bool = False
    running: bool = False  # a transaction job is out
    started_at: float = float("-inf")  # when the last transaction job went out (clock)
    buffer: list[tuple[OutboxRow, Headers, DeliveryCallback]] = field(default_factory=list)
    #: Committed rows whose mark is not confirmed, with their event_digest.
    unconfirmed: dict[RowId, int] = field(default_factory=dict)
    poisoned: bool = False  # a transaction failed: nothing more until the pump rewinds


class TransactionalPublisher:
    """The pump's publisher in exactly-once mode.  Driven by the pump's thread only."""

    def __init__(self, *, config: dict[str, str], plain: Publisher, leases: LeaseManager,
                 table: str, position_topic: str, transactional_id_prefix: str,
                 recovery_store: RecoveryStore, log: Any, metrics: Any = None,
                 clock: Callable[[], float] = time.monotonic, commit_interval_s: float = 0.0,
                 outbox: str = "", on_fatal: Callable[[str], None] | None = None, nshards: int = 0) -> None:
        self._config = dict(config)
        self._nshards = nshards  # the position topic's partitions, should it be created again
        self._recreate_after = float("-inf")
        self._outbox = outbox  # migration 0013's identity, in every position record
        self._on_fatal = on_fatal
        self._commit_interval_s = commit_interval_s
        self._plain = plain
        self._leases = leases
        self._table = table
        self._position_topic = position_topic
        self._prefix = transactional_id_prefix
        self._store = recovery_store
        self._store_lock = threading.Lock()  # a Store is one connection: one thread at a time
        self._log = log
        self._metrics = metrics
        self._clock = clock
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._sent = SentRows()  # rows of open transactions handed to Kafka, delivered or not
        self._leaders = Leaders(self._config, clock)
        self._shards: dict[ShardId, _Shard] = {}
        self._retry: dict[ShardId, tuple[float, float]] = {}  # shard -> (not before, last wait)
        self._immediate: list[tuple[DeliveryCallback, OutboxRow, Outcome]] = []
        self._closing: list[ShardWorker] = []
        self._stopped = False
        self._next_due: float | None = None  # the earliest held-back transaction's start

    @staticmethod
    def prepare(config: dict[str, str], position_topic: str, nshards: int) -> None:
        """At start: the position topic exists with a partition per shard (or ConfigError)."""
        ensure_position_topic(config, position_topic, nshards)

    def transactional_id(self, shard: ShardId) -> str:
        return f"{self._prefix}{self._table}.{shard}"

    # -- the pump's hooks -----------------------------------------------------------------

    def ready(self, shard: ShardId) -> bool:
        """The shard's producer is initialized and its recovery done: it may be claimed."""
        state = self._shards.get(shard)
        return state is not None and state.ready

    def confirm_marked(self, ids: Iterable[RowId]) -> None:
        """Rows the pump found marked (or already published): no position record needs
        to list them any more."""
        done = set(ids)
        for state in self._shards.values():
            for row_id in done & state.unconfirmed.keys():
                del state.unconfirmed[row_id]

    def undelivered(self, row_id: RowId) -> bool:
        """relay.stalls: the row was handed to Kafka and its partition's leader did not take it."""
        return self._sent.undelivered(row_id)

    def leaderless(self, topic: str) -> frozenset[int] | None:
        """relay.stalls: the partitions of ``topic`` without a leader (None: not known)."""
        return self._leaders.leaderless(topic)

    def rewound(self) -> None:
        """The pump rewound: failed shards may produce again."""
        for state in self._shards.values():
            state.poisoned = False

    # -- PumpPublisher --------------------------------------------------------------------

    def send(self, row: OutboxRow, on_delivery: DeliveryCallback) -> Outcome | None:
        try:
            headers = encode_headers(row)
        except BadRow as exc:
            return Outcome(ok=False, error_class="bad_headers", message=str(exc), permanent=True)
        state = self._shards.get(row.shard)
        if state is None or not state.ready:
            outcome = Outcome(ok=False, error_class="shard_not_ready",
                              message="the shard's transactional producer is not ready")
        elif state.poisoned:
            outcome = Outcome(ok=False, error_class="earlier_transaction_failed",
                              message="an earlier transaction of this shard failed")
        elif row.id in state.unconfirmed and state.unconfirmed[row.id] == event_digest(row.event_id):
            # committed already; its mark was lost
            outcome = Outcome(ok=True)
        else:
            state.buffer.append((row, headers, on_delivery))
            return None
        self._immediate.append((on_delivery, row, outcome))
        return None

    def poll(self, timeout_s: float) -> int:
        self._sync_leases()
        served = self._serve_immediate() + self._drain_results(None)
        self._start_jobs()
        if not served and timeout_s > 0:
            if self._next_due is not None:  # wake for a transaction held back until then
                timeout_s = min(timeout_s, max(0.0, self._next_due - self._clock()))
            served = self._drain_results(timeout_s)
            self._start_jobs()
        self._plain.poll(0)
        return served

    def partition_of(self, row: OutboxRow) -> int | None:
        return self._plain.partition_of(row)

    def recreate(self) -> None:
        """Never asked for (no outcome here is ``fatal``); a broken shard producer is
        replaced by its own worker's successor."""

    def send_dead_letter(self, row: OutboxRow, *, topic: str, reason: str, error: str,
                         attempts: int) -> str | None:
        return self._plain.send_dead_letter(row, topic=topic, reason=reason, error=error,
                                            attempts=attempts)

    def start(self) -> None:
        """Nothing to start: a shard's worker thread starts when its lease is held (on
        the pump's thread, inside ``send``/``poll``)."""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close every shard's worker (waiting up to ``timeout_s`` for their threads) and
        the recovery connection.  Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for shard in list(self._shards):
            self._close_shard(shard, "closing")
        deadline = self._clock() + timeout_s
        for worker in self._closing:
            worker.join(max(0.0, deadline - self._clock()))
        self._closing.clear()
        close = getattr(self._store, "close", None)
        if close is not None:
            close()

    # -- internals ------------------------------------------------------------------------

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
            self._shards[shard] = _Shard(ShardWorker(
                shard, token, config=self._config, transactional_id=self.transactional_id(shard),
                position_topic=self._position_topic, recover=self._recover, results=self._results,
                outbox=self._outbox, sent=self._sent))

    def _close_shard(self, shard: ShardId, why: str) -> None:
        state = self._shards.pop(shard)
        state.worker.close()
        self._closing.append(state.worker)
        self._closing = [w for w in self._closing if w._thread.is_alive()]  # noqa: SLF001
        self._fail_buffer(state, "lease_lost" if why == "lease_gone" else why)

    def _fail_buffer(self, state: _Shard, why: str) -> None:
        outcome = Outcome(ok=False, error_class=why, message=f"not produced: {why}")
        for row, _headers, callback in state.buffer:
            self._immediate.append((callback, row, outcome))
        state.buffer.clear()

    def _serve_immediate(self) -> int:
        served, self._immediate = self._immediate, []
        for callback, row, outcome in served:
            callback(row, outcome)
        return len(served)

    def _drain_results(self, timeout_s: float | None) -> int:
        served = 0
        block = timeout_s is not None
        while True:
            try:
                result = self._results.get(timeout=timeout_s) if block else self._results.get_nowait()
            except queue.Empty:
                return served + self._serve_immediate()
            block = False
            served += self._apply(result)

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

    def _apply_init(self, result: Result, state: _Shard | None) -> int:
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

    def _recreate_position_topic(self) -> None:
        """A position partition not found: a topic deleted meanwhile is created again (every 5 s at
        most) and said so; not one whose partition has no leader (said missing until an audit)."""
        now = self._clock()
        if now < self._recreate_after or not self._nshards:
            return
        self._recreate_after = now + POSITION_RECREATE_EVERY_S
        try:
            created = ensure_position_topic(self._config, self._position_topic, self._nshards)
        except (ConfigError, BrokerUnreachable) as exc:
            self._log.warning("exactly_once_position_topic_not_created", topic=self._position_topic, error=str(exc))
            return
        if created:
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

    def _start_jobs(self) -> None:
        """Start a transaction for every shard with rows buffered and none running, unless
        its last one started less than the commit interval ago and the buffer is not full:
        those rows wait to go in the next one (:attr:`_next_due` says when)."""
        now = self._clock()
        self._next_due = None
        for shard, state in self._shards.items():
            if not state.ready or state.running or not state.buffer:
                continue
            if state.poisoned:
                self._fail_buffer(state, "earlier_transaction_failed")
                continue
            if not self._leases.trusted(shard, now):
                self._fail_buffer(state, "lease_untrusted")
                continue
            due = state.started_at + self._commit_interval_s
            if now < due and len(state.buffer) < FULL_TRANSACTION_ROWS:
                self._next_due = due if self._next_due is None else min(self._next_due, due)
                continue
            take = state.buffer[:MAX_ROWS_PER_TRANSACTION]
            del state.buffer[:MAX_ROWS_PER_TRANSACTION]
            state.running = True
            state.started_at = now
            listed = {**state.unconfirmed, **{row.id: event_digest(row.event_id) for row, _h, _cb in take}}
            state.worker.submit(Job(rows=[(row, h) for row, h, _cb in take],
                                    position=sorted(listed.items()),
                                    callbacks={row.id: cb for row, _h, cb in take}))
        self._serve_immediate()

