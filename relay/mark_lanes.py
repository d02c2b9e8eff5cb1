"""Marks on several connections at once: :class:`MarkLanes`, one :class:`relay.marker.Marker`
(a mark thread and its connection) per lane.

``--mark-connections`` (one by default since issue 18's twelfth pass, see relay/options.py;
two or more on a database with cores to spare): a mark is a non-HOT update of every row it
marks, and while it cost 20-30 µs a row one marking backend was the relay's bound (busy
69-98 % of a core, the second core half idle).  A large batch is split between the lanes by shard, and a shard's
mark never starts before its previous one ended, so the rows of a key are marked in the
order they were claimed, as on one connection.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from operator import attrgetter
from typing import Any

from relay.marker import MarkCancelled, Marker, MarkOutcome, MarkStore, ProbedStore, holding
from relay.model import OutboxRow, RowId, ShardId, Token

#: A batch of at least this many rows is split between the mark lanes; a smaller one goes
#: whole to one lane (a paced relay's marks stay one statement each, on one connection).
SPLIT_ROWS = 200
#: How long a mark connection that failed its probe waits before the next one.
PROBE_EVERY_S = 10.0

_SHARD = attrgetter("shard")


class MarkLanes:
    """Marks on several connections at once (one :class:`Marker` per store), each shard's
    marks in submission order.

    :meth:`submit` splits a batch of :data:`SPLIT_ROWS` rows or more between the lanes by
    shard: a shard stays on the lane that marked it last, and shards move from the busiest
    lane to the idlest when the split is uneven by more than a quarter of the batch (never so
    far that the idlest becomes the busiest).  A
    smaller batch goes whole to one lane.  A part whose shard was last sent to another lane
    that has not marked it yet waits for that mark (the part's ``after``): a shard's marks
    never run on two connections at once and commit in submission order, so a key's rows
    (one shard) are marked in the order they were claimed, and what is marked of a key is a
    prefix of what was claimed, as with one lane.  In a steady drain shards stay put and
    nothing waits; a move costs one wait.  Each part carries only its shards' lease tokens;
    the future of the batch combines the parts' outcomes (a shard is held if its part's
    statement found it held).  A part that fails fails the whole batch's future, and the
    rows the other parts marked stay marked: the pump counts them as not marked, which costs
    a metric, never a row.

    A lane other than the first gets work only once its connection answered a probe, run in
    a thread of its own at the first batch large enough to split after the first lane has
    marked (:meth:`_probe`): the first mark connection is opened before the others, so a
    pool sized for fewer connections than the relay may hold keeps what one lane needs.
    """

    def __init__(self, stores: Sequence[MarkStore], owner: str, *, split_rows: int = SPLIT_ROWS,
                 max_rows: int = 10_000, log: Any = None, probe_every_s: float = PROBE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_cancel: Callable[[str], None] = lambda connection: None) -> None:
        """``on_cancel``: counts a mark statement the server cancelled, by its connection's name
        (each is marked again on its lane: relay/mark_cancels.py)."""
        if not stores:
            raise ValueError("MarkLanes needs at least one store")
        self.lanes = [Marker(store, owner, max_rows=max_rows, log=log, on_cancel=on_cancel,
                             name="outbox-relay-mark" + (f"-{i + 1}" if i else ""))
                      for i, store in enumerate(stores)]
        self.split_rows = split_rows
        self.log = log
        self.probe_every_s = probe_every_s
        self.clock = clock
        self._lock = threading.Lock()
        # The last part sent for each shard still marking: its lane and its future.
        self._last: dict[ShardId, tuple[int, Future[MarkOutcome]]] = {}
        self._queued: list[int] = [0] * len(stores)  # rows submitted and not yet marked
        self.moves = 0  # shards sent to another lane while their last mark was running
        # A lane gets work once its connection answered (:meth:`_probe`); the first lane's is
        # the relay's own mark connection, and a store that cannot be probed is taken as is.
        self._ready = [i == 0 or not isinstance(store, ProbedStore) for i, store in enumerate(stores)]
        self._probing = [False] * len(stores)
        self._next_probe = [0.0] * len(stores)
        self._first_marked = False  # the first lane's connection has marked: probes may start

    @property
    def store(self) -> MarkStore:
        """The first lane's store: the pump marks on it, on its own thread, when nothing is
        marking (a paced relay's small batches)."""
        return self.lanes[0].store

    def cancelling(self) -> bool:
        """Is a lane marking again rows whose mark the server cancelled (relay/mark_cancels.py)?"""
        return any(lane.cancels.in_a_row for lane in self.lanes)

    def cancelled(self, exc: MarkCancelled) -> None:
        """The pump's own mark on a lane's connection (:attr:`store`) was cancelled: that
        lane counts it and waits a back-off before its next statement; the pump then submits
        the rows (relay/pump_settle.py), marked again instead of claimed again."""
        for lane in self.lanes:
            if lane.store is exc.store:
                lane.cancelled(exc)

    def start(self) -> None:
        for lane in self.lanes:
            lane.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish what was submitted, then stop every lane, waiting ``timeout_s`` in all.
        Idempotent."""
        for lane in self.lanes:
            lane.request_stop()
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes:
            lane.join(max(0.0, deadline - time.monotonic()))

    def submit(self, tokens: dict[ShardId, Token], rows: list[OutboxRow]) -> Future[MarkOutcome]:
        """Queue a mark of ``rows`` fenced by ``tokens``; its outcome comes in the future.
        Called from one thread (the pump's): the order of its calls is the marks' order."""
        parts: list[tuple[int, int, set[ShardId], Future[MarkOutcome]]] = []
        with self._lock:  # routed and queued together: a shard's parts queue in order
            for lane, part in self._route(rows):
                shards = set(map(_SHARD, part))
                after: set[Future[MarkOutcome]] = set()
                for shard in shards:
                    home = self._home(shard)
                    if home is not None and home != lane:
                        after.add(self._last[shard][1])  # its lane's later marks come after it
                        self.moves += 1
                tokens_part = {shard: token for shard, token in tokens.items() if shard in shards}
                future = self.lanes[lane].submit(tokens_part, part, after=tuple(after))
                for shard in shards:
                    self._last[shard] = (lane, future)
                self._queued[lane] += len(part)
                parts.append((lane, len(part), shards, future))
        for lane, count, shards, future in parts:  # outside the lock: a done future calls back at once
            future.add_done_callback(functools.partial(self._settled, lane, count, shards))
        if len(parts) == 1:
            return parts[0][3]
        return _combined([(shards, future) for _lane, _count, shards, future in parts])

    def _settled(self, lane: int, rows: int, shards: set[ShardId], future: Future[MarkOutcome]) -> None:
        with self._lock:
            if lane == 0 and future.exception() is None:
                self._first_marked = True
            self._queued[lane] -= rows
            for shard in shards:  # a done part holds its result: not kept past its shards' next
                last = self._last.get(shard)
                if last is not None and last[1] is future:
                    del self._last[shard]

    def _home(self, shard: ShardId) -> int | None:
        """The lane still marking ``shard`` (under the lock)."""
        last = self._last.get(shard)
        return last[0] if last is not None and not last[1].done() else None

    def _route(self, rows: list[OutboxRow]) -> list[tuple[int, list[OutboxRow]]]:
        """Which lane marks which rows (under the lock)."""
        if len(rows) >= self.split_rows and self._first_marked and not all(self._ready):
            self._probe_idle_lanes()
        ready = [lane for lane, ok in enumerate(self._ready) if ok]
        # A connection lost again and again waits out its re-open's back-off (relay/marker.py
        # MarkLosses): the others mark meanwhile; all held, the work waits on its lane.
        ready = [lane for lane in ready if not holding(self.lanes[lane].store)] or ready
        if len(ready) == 1:
            return [(ready[0], rows)]
        per_shard = Counter(map(_SHARD, rows))
        homes = {shard: self._home(shard) for shard in per_shard}
        if len(rows) < self.split_rows:
            weight: Counter[int] = Counter()
            for shard, home in homes.items():
                if home is not None and home in ready:
                    weight[home] += per_shard[shard]
            lane = (weight.most_common(1)[0][0] if weight
                    else min(ready, key=self._queued.__getitem__))
            return [(lane, rows)]
        load = dict.fromkeys(ready, 0)
        assigned: dict[ShardId, int] = {}
        for shard, count in sorted(per_shard.items(), key=lambda item: -item[1]):
            home = homes[shard]
            lane = home if home in load else min(load, key=load.__getitem__)
            assigned[shard] = lane
            load[lane] += count
        for _ in range(len(per_shard)):  # even out a split that is off by over a quarter
            busy, idle = max(load, key=load.__getitem__), min(load, key=load.__getitem__)
            gap = load[busy] - load[idle]
            if gap * 4 <= len(rows):
                break
            # A move never turns the idle lane into the busy one: the next batch would move
            # the shard back (a wait each time) when a few shards cannot be evened out.
            movable = [(shard, per_shard[shard]) for shard, lane in assigned.items()
                       if lane == busy and per_shard[shard] * 2 <= gap]
            if not movable:
                break
            shard, count = max(movable, key=lambda item: item[1])
            assigned[shard] = idle
            load[busy] -= count
            load[idle] += count
        parts: dict[int, list[OutboxRow]] = {}
        for row in rows:
            parts.setdefault(assigned[row.shard], []).append(row)
        return sorted(parts.items())

    def _probe_idle_lanes(self) -> None:
        """Start a probe of each lane not yet known to answer (under the lock)."""
        now = self.clock()
        for lane, ok in enumerate(self._ready):
            if not ok and not self._probing[lane] and now >= self._next_probe[lane]:
                self._probing[lane] = True
                threading.Thread(target=self._probe, args=(lane,), daemon=True,
                                 name=f"outbox-relay-mark-probe-{lane + 1}").start()

    def _probe(self, lane: int) -> None:
        """Open the lane's connection and make one round trip, in a thread of its own: the
        lane gets work only once that answered.  A connection that cannot get a server (a
        session pooler sized for fewer connections than the relay holds waits for a free
        one) then costs the relay its second connection's speed, never a mark stuck behind
        it.  A probe that fails is tried again :attr:`probe_every_s` later, at the next batch
        large enough to split."""
        store = self.lanes[lane].store
        assert isinstance(store, ProbedStore)  # the others are ready from the start
        started = self.clock()
        try:
            store.ping()
        except Exception as exc:  # the relay's database errors, or anything the driver raised
            with self._lock:
                self._probing[lane] = False
                self._next_probe[lane] = self.clock() + self.probe_every_s
            if self.log is not None:
                self.log.warning("mark_connection_unavailable", connection=lane + 1, error=str(exc),
                                 note=f"marking on fewer connections; tried again in {self.probe_every_s:g} s")
            return
        with self._lock:
            self._probing[lane] = False
            self._ready[lane] = True
        if self.log is not None:
            self.log.info("mark_connection_ready", connection=lane + 1,
                          waited_s=round(self.clock() - started, 3))


def _combined(parts: list[tuple[set[ShardId], Future[MarkOutcome]]]) -> Future[MarkOutcome]:
    """One future for a batch marked in parts (each with its shards): the shards each part
    found held among its own, the rows the parts marked and the longest part's time, or the
    first part's error."""
    combined: Future[MarkOutcome] = Future()
    lock = threading.Lock()
    futures = [future for _shards, future in parts]
    left = [len(futures)]

    def settled(_future: Future[MarkOutcome]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [error for error in (f.exception() for f in futures) if error is not None]
        if errors:
            combined.set_exception(errors[0])
            return
        held: set[ShardId] = set()
        marked: set[RowId] = set()
        took = 0.0
        for shards, future in parts:
            part_held, part_marked, part_took = future.result()
            held |= part_held & shards
            marked |= part_marked
            took = max(took, part_took)
        combined.set_result((held, marked, took))

    for future in futures:
        future.add_done_callback(settled)
    return combined
