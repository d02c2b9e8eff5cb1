"""The periodic sweep (a rewind to "nothing seen", every SWEEP_INTERVAL_S while caught up)
costs what the index of pending rows holds in front of the window.  A session idle in
transaction keeps every row marked since it began in that index (vacuum may not remove
them yet): measured on PostgreSQL 18, 200,000 rows made each sweep cost about 160 ms (the
claim 120 ms, the foreign-xid restamp 40 ms), against 4 ms without the idle session; an
hour of 1,000 events/s makes it seconds, every 10 s, with the pump blocked meanwhile.  A
costly sweep now puts the next one SWEEP_COST_RATIO times its cost away.  Pure logic: a
store whose sweep claim takes time on the fake clock."""

from __future__ import annotations

from typing import Any

from relay.metrics import RelayMetrics
from relay.model import Claimed, Cursor, RowId
from relay.pump import SWEEP_COST_RATIO, SWEEP_INTERVAL_S, Pump
from tests.unit.pump_fakes import Clock, Leases, Publisher, Store, row


class SlowSweepStore(Store):
    """A claim from "nothing seen" (a sweep's) takes ``sweep_s`` on the clock; others none."""

    def __init__(self, clock: Clock, sweep_s: float) -> None:
        super().__init__([])
        self.clock, self.sweep_s, self.sweeps = clock, sweep_s, 0

    def claim(self, *, shards: Any, nshards: int, after: Cursor, limit: int, **kw: Any) -> Claimed:
        if after.fresh:
            self.sweeps += 1
            self.clock.advance(self.sweep_s)
        return super().claim(shards=shards, nshards=nshards, after=after, limit=limit, **kw)


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def pump_with(store: Store, clock: Clock, log: Log) -> Pump:
    return Pump(store=store, publisher=Publisher(), leases=Leases(), nshards=2,  # type: ignore[arg-type]
                batch_size=100, pipeline_depth=4, max_attempts=3, backoff_initial_s=0.1,
                backoff_max_s=1.0, metrics=RelayMetrics(), log=log, clock=clock,
                claim_interval_s=0.0, claim_interval_max_s=0.0)


def sweeps_in(seconds: float, sweep_s: float) -> tuple[int, Log, SlowSweepStore]:
    """Run a caught-up pump for ``seconds`` of fake time, a row arriving every second."""
    clock, log = Clock(), Log()
    store = SlowSweepStore(clock, sweep_s)
    pump = pump_with(store, clock, log)
    end, n = clock() + seconds, 0
    while clock() < end:
        n += 1
        store.pending[RowId(n)] = row(n, n % 2)
        pump.run_once()
        pump.run_once()  # the reports, the mark
        clock.advance(1.0)
    return store.sweeps, log, store


def test_a_cheap_sweep_keeps_its_interval() -> None:
    sweeps, log, store = sweeps_in(300.0, sweep_s=0.01)
    # The first claim's rewind, then one about every SWEEP_INTERVAL_S (+1 s of arrivals).
    assert 300 / (SWEEP_INTERVAL_S + 1) <= sweeps <= 300 / SWEEP_INTERVAL_S + 1
    assert not log.warnings
    assert not store.pending  # every row went out meanwhile


def test_a_costly_sweep_puts_the_next_one_further_away_and_says_why() -> None:
    sweep_s = 2.0
    sweeps, log, store = sweeps_in(1000.0, sweep_s)
    # One sweep per SWEEP_COST_RATIO x its cost (100 s), not one per 10 s (a fifth of the
    # pump's time): at most ~2 % of it.
    assert sweeps <= 1000 / (SWEEP_COST_RATIO * sweep_s) + 1
    assert sweeps * sweep_s <= 0.03 * 1000
    slow = [fields for event, fields in log.warnings if event == "sweep_slow"]
    assert len(slow) == sweeps
    assert slow[0]["seconds"] == sweep_s and slow[0]["next_sweep_in_s"] == SWEEP_COST_RATIO * sweep_s
    assert "idle in transaction" in slow[0]["hint"]
    assert not store.pending
