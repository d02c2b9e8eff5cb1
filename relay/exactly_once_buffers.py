"""Exactly-once mode, the pump's side (relay/exactly_once.py has the whole design): the
rows the pump sends buffered per shard and started as transactions on the shards' workers
(``poll``), the outcomes served back to the pump's callbacks, and the hooks the pump calls
(``ready``, ``confirm_marked``, ``rewound``, ...).

:class:`BufferingPublisher` holds the state of every held shard (:class:`ShardState`); its
subclass :class:`relay.exactly_once.TransactionalPublisher` keeps it in step with the
leases and the workers' results (initialised, recovered, committed, fenced).  Split from
relay/exactly_once.py at its 400-line limit: this side only buffers, starts and serves.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from relay.errors import ConfigError
from relay.exactly_once_leaders import Leaders
from relay.exactly_once_position import RecoveryStore, event_digest
from relay.exactly_once_records import smallest_limit_bytes
from relay.exactly_once_shard import Headers, Job, Result, SentRows, ShardWorker
from relay.kafka_config import max_message_bytes
from relay.leases import LeaseManager
from relay.model import OutboxRow, RowId, ShardId
from relay.outcomes import Outcome
from relay.publisher import BadRow, DeliveryCallback, Publisher, encode_headers

MAX_ROWS_PER_TRANSACTION = 20_000
#: A shard's buffer this full starts its transaction without waiting out the commit interval:
#: a backlog is drained in transactions of this size or more, back to back.
FULL_TRANSACTION_ROWS = 1_000


@dataclass(slots=True)
class ShardState:
    """A held shard: its worker, the rows buffered for its next transaction, and what its
    committed transactions listed that is not confirmed marked yet."""

    worker: ShardWorker
    ready: bool = False
    running: bool = False  # a transaction job is out
    started_at: float = float("-inf")  # when the last transaction job went out (clock)
    buffer: list[tuple[OutboxRow, Headers, DeliveryCallback]] = field(default_factory=list)
    #: Committed rows whose mark is not confirmed, with their event_digest.
    unconfirmed: dict[RowId, int] = field(default_factory=dict)
    poisoned: bool = False  # a transaction failed: nothing more until the pump rewinds



class BufferingPublisher(ABC):
    """The pump's publisher in exactly-once mode, as the pump sees it.  Driven by the pump's
    thread only.  The subclass keeps the shards in step with the leases
    (:meth:`_sync_leases`) and applies the workers' results (:meth:`_apply`)."""

    def __init__(self, *, config: dict[str, str], plain: Publisher, leases: LeaseManager,
                 table: str, position_topic: str, transactional_id_prefix: str,
                 recovery_store: RecoveryStore, log: Any, metrics: Any = None,
                 clock: Callable[[], float] = time.monotonic, commit_interval_s: float = 0.0,
                 outbox: str = "", on_fatal: Callable[[str], None] | None = None, nshards: int = 0,
                 record_limit_bytes: int | None = None) -> None:
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
        #: A position record's largest size: the topic's limit prepare() read at start (the
        #: producer's when not given), read again when the topic is created again, cut when
        #: refused; handed to the shards' workers with each transaction's job.
        self._record_limit = max_message_bytes(config) if record_limit_bytes is None else record_limit_bytes
        if self._record_limit < smallest_limit_bytes(outbox):
            raise ConfigError(f"exactly-once: records of at most {self._record_limit} bytes (the producer's "
                              f"message.max.bytes or {position_topic}'s max.message.bytes) cannot hold a "
                              f"position record of one row: raise it")
        self._prefix = transactional_id_prefix
        self._store = recovery_store
        self._store_lock = threading.Lock()  # a Store is one connection: one thread at a time
        self._log = log
        self._metrics = metrics
        self._clock = clock
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._sent = SentRows()  # rows of open transactions handed to Kafka, delivered or not
        self._leaders = Leaders(self._config, clock)
        self._shards: dict[ShardId, ShardState] = {}
        self._retry: dict[ShardId, tuple[float, float]] = {}  # shard -> (not before, last wait)
        self._immediate: list[tuple[DeliveryCallback, OutboxRow, Outcome]] = []
        self._closing: list[ShardWorker] = []
        self._stopped = False
        self._next_due: float | None = None  # the earliest held-back transaction's start

    @property
    def record_limit_bytes(self) -> int:
        """The largest position record the next transactions write (with its overhead)."""
        return self._record_limit

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

    def recreate(self) -> None:  # noqa: B027 - nothing to do, on purpose (the publisher's interface)
        """Never asked for (no outcome here is ``fatal``); a broken shard producer is
        replaced by its own worker's successor."""

    def send_dead_letter(self, row: OutboxRow, *, topic: str, reason: str, error: str,
                         attempts: int) -> str | None:
        return self._plain.send_dead_letter(row, topic=topic, reason=reason, error=error,
                                            attempts=attempts)

    def start(self) -> None:  # noqa: B027 - nothing to do, on purpose (the publisher's interface)
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

    # -- the shards' buffers and outcomes -------------------------------------------------

    @abstractmethod
    def _sync_leases(self) -> None:
        """A worker for each shard held, none for one not held (the subclass's)."""

    @abstractmethod
    def _apply(self, result: Result) -> int:
        """A worker's result applied; returns the callbacks served (the subclass's)."""

    def _close_shard(self, shard: ShardId, why: str) -> None:
        state = self._shards.pop(shard)
        state.worker.close()
        self._closing.append(state.worker)
        self._closing = [w for w in self._closing if w._thread.is_alive()]  # noqa: SLF001
        self._fail_buffer(state, "lease_lost" if why == "lease_gone" else why)

    def _fail_buffer(self, state: ShardState, why: str) -> None:
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
                                    callbacks={row.id: cb for row, _h, cb in take},
                                    limit_bytes=self._record_limit))
        self._serve_immediate()
