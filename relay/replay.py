"""Replays: republish retained outbox rows of the shards this replica holds, in commit order.

A replay request (``outbox-relay replay``, table ``outbox_relay_replays``) selects
published rows still in the outbox.  For each active replay and each shard it holds,
a replica reads the next rows after the replay's stored position in first-publication
order ``(published_at, xid, id)`` (a key's commit order), produces them through the
relay's :class:`~relay.publisher.Publisher` with their original key, value, headers
and ``event_id`` plus a ``replay_id`` header, and, once every row of the batch is
acknowledged, moves the position (fenced by the shard's lease token).  One batch per
(replay, shard) is in flight at a time, so a key's rows go out in order, and the batches
in flight hold at most ``budget_bytes`` of messages together (``--batch-max-bytes``); a takeover
or a restart continues from the last stored position: at least once per replay.

Throttled per replay: ``rate_per_s`` events per second over all replicas, each taking
its share (shards held / shards).  The relay's loop calls :meth:`Replayer.run_once`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from relay.metrics import RelayMetrics
from relay.model import Lease, OutboxRow, ShardId, Token
from relay.options import DEFAULT_BATCH_MAX_BYTES
from relay.outcomes import Outcome
from relay.replay_store import MAX_REPLAY_RATE, Fence, Position, ReplayRow

#: Rows read and produced at once for one (replay, shard).
REPLAY_BATCH_ROWS = 500
#: How often the list of active replays (and the rows-left gauge) is refreshed while
#: replays run, and while none does (one cheap statement; the idle cost stays low).
REFRESH_INTERVAL_S = 1.0
IDLE_REFRESH_INTERVAL_S = 5.0
#: Wait before re-reading a batch that was not fully acknowledged (the producer's local
#: queue was full: a moment only).
RETRY_AFTER_S = 1.0
QUEUE_FULL_RETRY_S = 0.05


class ReplaySink(Protocol):
    def send(self, row: OutboxRow, on_delivery: Callable[[OutboxRow, Outcome], None]) -> Outcome | None: ...
    def poll(self, timeout: float) -> Any: ...


class ReplaySource(Protocol):
    def active_replays(self) -> list[dict[str, Any]]: ...
    def load_progress(self, replay_id: int,
                      shards: Sequence[ShardId]) -> dict[ShardId, tuple[Position, bool]]: ...
    def batch(self, *, replay_id: int, shard: ShardId, nshards: int, after: Position,
              limit: int, budget_bytes: int) -> list[ReplayRow]: ...
    def advance(self, *, replay_id: int, shard: ShardId, owner: str, token: Token,
                start: Position, to: Position, sent: int, done: bool) -> Fence: ...
    def finish(self, *, replay_id: int, nshards: int) -> bool: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class ReplayResult:
    """What one run did; tests and logs read it."""

    sent: int = 0
    acked: int = 0
    advanced: int = 0
    skipped: int = 0
    failed: int = 0
    fenced: int = 0
    finished: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Batch:
    rows: list[ReplayRow]
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    size: int = 0  # bytes of its messages (payload, key, headers)

    def complete(self) -> bool:
        return len(self.outcomes) == len(self.rows)


@dataclass(slots=True)
class _ShardState:
    token: Token
    position: Position
    done: bool
    batch: _Batch | None = None
    not_before: float = 0.0


@dataclass(slots=True)
class _Replay:
    id: int
    rate_per_s: float
    tokens: float = 0.0
    refilled: float = 0.0
    shards: dict[ShardId, _ShardState] = field(default_factory=dict)


class Replayer:
    """Drives the active replays of this replica.  Runs on the relay loop's thread."""

    def __init__(self, store: ReplaySource, publisher: ReplaySink, *, owner: str, nshards: int,
                 metrics: RelayMetrics, log: Any, clock: Callable[[], float] = time.monotonic,
                 lose: Callable[[list[ShardId], str], None] = lambda shards, why: None,
                 batch_rows: int = REPLAY_BATCH_ROWS, budget_bytes: int = DEFAULT_BATCH_MAX_BYTES,
                 refresh_interval_s: float = REFRESH_INTERVAL_S) -> None:
        self.store = store
        self.publisher = publisher
        self.owner = owner
        self.nshards = nshards
        self.metrics = metrics
        self.log = log
        self.clock = clock
        self.lose = lose
        self.batch_rows = batch_rows
        #: Bytes of messages in flight over every replay and shard (a batch's first row
        #: always goes, so one row larger than this is sent alone).
        self.budget_bytes = budget_bytes
        self.refresh_interval_s = refresh_interval_s
        self.replays: dict[int, _Replay] = {}
        self._next_refresh = 0.0
        self._stopped = False
        self._labels: set[str] = set()

    def start(self) -> None:
        self._stopped = False

    def stop(self, timeout_s: float = 0.0) -> None:
        """Forget what is in flight (its rows go out again after a restart) and close the
        connection.  Idempotent; no thread of its own, so ``timeout_s`` is not waited."""
        if self._stopped:
            return
        self._stopped = True
        self.replays.clear()
        self.store.close()

    def busy(self) -> bool:
        """A batch waits for its acknowledgements, or rows wait for the rate."""
        return any(state.batch is not None or not state.done
                   for replay in self.replays.values() for state in replay.shards.values())

    def wait(self, timeout_s: float) -> None:
        self.publisher.poll(timeout_s)

    def run_once(self, leases: Sequence[Lease]) -> ReplayResult:
        result = ReplayResult()
        if self._stopped:
            return result
        now = self.clock()
        if now >= self._next_refresh:
            self._refresh(now)
            self._next_refresh = now + (self.refresh_interval_s if self.replays
                                        else max(self.refresh_interval_s, IDLE_REFRESH_INTERVAL_S))
        if not self.replays:
            return result
        self.publisher.poll(0)
        held = {lease.shard: lease.token for lease in leases}
        for replay in list(self.replays.values()):
            self._run_replay(replay, held, now, result)
        return result

    # -- one replay -----------------------------------------------------------------------

    def _refresh(self, now: float) -> None:
        rows = self.store.active_replays()
        active = {int(r["id"]): r for r in rows}
        for gone in set(self.replays) - set(active):
            del self.replays[gone]
        for replay_id, row in active.items():
            if replay_id not in self.replays:
                # A second's worth of events to start with (the bucket holds at most that).
                self.replays[replay_id] = _Replay(replay_id, float(row["rate_per_s"]), refilled=now - 1.0)
                self.log.info("replay_started", replay_id=replay_id, rate_per_s=float(row["rate_per_s"]))
            self.metrics.replay_rows_left.labels(str(replay_id)).set(int(row["rows_left"]))
        labels = {str(i) for i in active}
        for label in self._labels - labels:  # bounded: only active replays keep a series
            self.metrics.replay_rows_left.remove(label)
            self.metrics.replayed.remove(label)
        self._labels = labels

    def _run_replay(self, replay: _Replay, held: dict[ShardId, Token], now: float,
                    result: ReplayResult) -> None:
        for shard in [s for s, st in replay.shards.items() if held.get(s) != st.token]:
            del replay.shards[shard]  # lease lost or renewed under a new token: reload
        missing = sorted(s for s in held if s not in replay.shards)
        if missing:
            progress = self.store.load_progress(replay.id, missing)
            for shard in missing:
                position, done = progress.get(shard, (Position(), False))
                replay.shards[shard] = _ShardState(held[shard], position, done)
        # A rate that is not a number (inf or NaN, stored by a CLI that did not refuse it)
        # is read as the batch size a second: a relay must not die on a replay's row.
        # A rate above the CLI's bound (1e308 overflowed the bucket to inf) is read as that bound.
        rate = (min(replay.rate_per_s, MAX_REPLAY_RATE) if math.isfinite(replay.rate_per_s)
                else float(self.batch_rows))
        share = rate * len(held) / max(1, self.nshards)
        replay.tokens = min(max(1.0, share), replay.tokens + (now - replay.refilled) * share)
        replay.refilled = now
        finished_shard = False
        for shard in sorted(replay.shards):
            state = replay.shards[shard]
            if state.batch is not None:
                if not state.batch.complete():
                    continue
                finished_shard |= self._settle(replay, shard, state, result)
            if state.done or state.batch is not None or now < state.not_before:
                continue
            limit = min(self.batch_rows, int(replay.tokens))
            room = self.budget_bytes - self._bytes_in_flight()
            if limit < 1 or room <= 0:
                break
            finished_shard |= self._send(replay, shard, state, limit, room, result)
            if replay.id not in self.replays:
                return
        if finished_shard and all(st.done for st in replay.shards.values()):
            if self.store.finish(replay_id=replay.id, nshards=self.nshards):
                self.log.info("replay_done", replay_id=replay.id)
                result.finished.append(replay.id)
                self.replays.pop(replay.id, None)
                self._next_refresh = 0.0

    def _bytes_in_flight(self) -> int:
        return sum(state.batch.size for replay in self.replays.values()
                   for state in replay.shards.values() if state.batch is not None)

    def _send(self, replay: _Replay, shard: ShardId, state: _ShardState, limit: int, room: int,
              result: ReplayResult) -> bool:
        rows = self.store.batch(replay_id=replay.id, shard=shard, nshards=self.nshards,
                                after=state.position, limit=limit, budget_bytes=room)
        if not rows:
            return self._advance(replay, shard, state, state.position, 0, True, result)
        batch = _Batch(rows, size=sum(item.row.size for item in rows))
        state.batch = batch
        replay.tokens -= len(rows)

        def report(row: OutboxRow, outcome: Outcome) -> None:
            batch.outcomes[row.id] = outcome

        for index, item in enumerate(rows):
            refused = self.publisher.send(item.row, report)
            if refused is not None:
                # Not queued (a full local queue, a bad row): nothing after it goes out now,
                # so no later row of its key can overtake it.
                for rest in rows[index:]:
                    batch.outcomes[rest.row.id] = refused
                break
            result.sent += 1
        return False

    def _settle(self, replay: _Replay, shard: ShardId, state: _ShardState,
                result: ReplayResult) -> bool:
        batch = state.batch
        assert batch is not None
        state.batch = None
        # Acknowledged rows up to the first transient failure count; rows refused for
        # good (too large now, bad headers) are skipped with a log line, never retried.
        upto = 0
        for item in batch.rows:
            outcome = batch.outcomes[item.row.id]
            if not outcome.ok and not outcome.permanent:
                break
            if not outcome.ok:
                result.skipped += 1
                self.log.warning("replay_row_skipped", replay_id=replay.id, row_id=item.row.id,
                                 event_id=item.row.event_id, reason=outcome.error_class)
            upto += 1
        result.acked += upto
        if upto < len(batch.rows):
            result.failed += len(batch.rows) - upto
            first = batch.outcomes[batch.rows[upto].row.id]
            state.not_before = self.clock() + (QUEUE_FULL_RETRY_S if first.error_class == "queue_full"
                                               else RETRY_AFTER_S)
            self.log.warning("replay_batch_failed", replay_id=replay.id, shard=shard,
                             unacknowledged=len(batch.rows) - upto, retry_in_s=RETRY_AFTER_S)
        if upto == 0:
            return False
        to = batch.rows[upto - 1].position
        return self._advance(replay, shard, state, to, upto, False, result)

    def _advance(self, replay: _Replay, shard: ShardId, state: _ShardState, to: Position,
                 sent: int, done: bool, result: ReplayResult) -> bool:
        fence = self.store.advance(replay_id=replay.id, shard=shard, owner=self.owner,
                                   token=state.token, start=state.position, to=to, sent=sent, done=done)
        if fence.written:
            state.position = to
            state.done = done
            result.advanced += sent
            if sent:
                self.metrics.replayed.labels(str(replay.id)).inc(sent)
            return done
        replay.shards.pop(shard, None)
        if not fence.active:  # cancelled (or finished by a peer): stop at once
            self.log.info("replay_stopped", replay_id=replay.id, reason="not_active")
            self.replays.pop(replay.id, None)
            self._next_refresh = 0.0
            return False
        result.fenced += 1
        self.metrics.fenced_writes.inc()
        if not fence.held:
            self.lose([shard], "replay_fenced")
        else:  # the stored position moved under us (should not happen): reload it
            self.log.warning("replay_position_moved", replay_id=replay.id, shard=shard)
        return False
