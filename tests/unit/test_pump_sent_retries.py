"""The pump tells each claim which rows in back-off it has sent since its last rewind
(``sent_retries``): a row in back-off holds its key's later rows in a window's claim, also
once its retry is due, until this relay has sent it (tests/integration/test_backoff_order.py
has the claim's side, with a real database). Sent: named until its mark; a rewind starts
the set again. Pure logic: a store that records what each claim was told."""

from __future__ import annotations

from typing import Any

from relay.metrics import RelayMetrics
from relay.model import Claimed, Cursor, RowId
from relay.pump import Pump
from tests.unit.pump_fakes import Clock, Leases, Log, Publisher, Store, row


class RecordingStore(Store):
    def __init__(self) -> None:
        super().__init__([])
        self.told: list[set[int]] = []

    def claim(self, *, shards: Any, nshards: int, after: Cursor, limit: int, **kw: Any) -> Claimed:
        self.told.append(set(kw.get("sent_retries", ())))
        return super().claim(shards=shards, nshards=nshards, after=after, limit=limit)


def pump_with(store: Store, publisher: Publisher) -> Pump:
    return Pump(store=store, publisher=publisher, leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=100, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=Log(), clock=Clock(),
                claim_interval_s=0.0, claim_interval_max_s=0.0)


def test_a_retried_row_is_named_to_the_claims_from_its_send_to_its_mark() -> None:
    store = RecordingStore()
    publisher = Publisher(partition_of=lambda r: 0, no_leader=0)  # no reports until it has a leader
    pump = pump_with(store, publisher)
    store.pending[RowId(1)] = row(1, 0)._replace(attempts=2)  # failed twice before (here or elsewhere)
    store.pending[RowId(2)] = row(2, 0)
    pump.run_once()  # the first claim (a full pass) sends both
    assert store.told == [set()] and publisher.sent == [1, 2]
    store.pending[RowId(3)] = row(3, 0)
    pump.run_once()  # row 1 in flight: the window's claim is told, so key0's row 3 may follow it
    assert store.told[-1] == {1} and publisher.sent == [1, 2, 3]
    publisher.no_leader = None  # reported, then marked: no longer in back-off
    store.pending[RowId(4)] = row(4, 0)
    pump.run_once()
    assert store.marked[:2] == [1, 2] and store.told[-1] == set()


def test_a_rewind_forgets_the_rows_sent_before_it() -> None:
    store = RecordingStore()
    publisher = Publisher(partition_of=lambda r: 0, no_leader=0)
    pump = pump_with(store, publisher)
    store.pending[RowId(1)] = row(1, 0)._replace(attempts=1)
    pump.run_once()  # sent, never reported
    assert pump.sent_retries == {1}
    pump.in_flight.clear()  # given up (as a failed batch is): the next full pass claims it again
    pump.request_rewind()
    pump.run_once()
    assert store.told[-1] == set() and publisher.sent == [1, 1]
