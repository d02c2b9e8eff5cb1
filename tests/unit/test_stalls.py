"""One partition that acknowledges nothing stops nothing else (issue 15, item 2).

Pure logic: the pump with a fake store, producer and clock.  Partition 0 of the topic has
no leader: its rows get no report.  The rows of every other partition keep being
produced, marked and claimed; partition 0's keys wait; once it acknowledges again a
rewind brings back what was skipped, in key order.
"""

from __future__ import annotations

from relay.metrics import RelayMetrics
from relay.model import OutboxRow
from relay.pump import Pump
from relay.stalls import STALL_AFTER_S, default_partition, murmur2
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row

KEYS = 8  # key k<i> goes to partition i % 2


def test_murmur2_matches_kafkas_own_test_vectors() -> None:
    # org.apache.kafka.common.utils.UtilsTest#testMurmur2, as signed 32-bit ints.
    cases = {"21": -973932308, "foobar": -790332482, "a-little-bit-long-string": -985981536,
             "a-little-bit-longer-string": -1486304829,
             "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971, "abc": 479470107}
    for text, expected in cases.items():
        assert murmur2(text.encode()) == expected & 0xFFFFFFFF, text
    assert default_partition(b"foobar", 7) == (-790332482 & 0x7FFFFFFF) % 7


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rows(start: int, count: int) -> list[OutboxRow]:
    return [row(i, 0, key=f"k{i % KEYS}") for i in range(start, start + count)]


def key_partition(r: OutboxRow) -> int | None:
    """Key k<i> goes to partition i % 2."""
    return int(r.key[1:]) % 2 if r.key else None


def test_a_partition_without_a_leader_stops_nothing_else() -> None:
    clock, store = Clock(), Store(rows(1, 40))
    publisher = Publisher(partition_of=key_partition, no_leader=0)
    metrics = RelayMetrics()
    pump = Pump(store=store, publisher=publisher, leases=Leases(shards=[0]), nshards=1, batch_size=10,  # type: ignore[arg-type]
                pipeline_depth=2, max_attempts=3, backoff_initial_s=0.1, backoff_max_s=1.0,
                metrics=metrics, log=Log(), clock=clock)
    for _ in range(10):
        pump.run_once()
    # Before the stall is noticed: batches settle in order, so the first one blocks the rest.
    assert store.marked == []
    clock.now += STALL_AFTER_S
    for step in range(20):
        pump.run_once()
        store.pending.update({r.id: r for r in rows(41 + step * 4, 4)})  # writers keep writing
        clock.now += 0.1
    odd = [i for i in store.marked if i % 2 == 1]
    assert len(odd) >= 40, store.marked  # partition 1 flows: marked and claimed anew
    assert all(i % 2 == 1 for i in store.marked)  # nothing of partition 0 was acknowledged
    assert metrics.registry.get_sample_value("outbox_relay_stalled_rows",
                                             {"topic": "t", "partition": "0"}) > 0
    publisher.poll(0)
    stuck = {r.id for r, _ in publisher.queued}
    assert stuck and all(i % 2 == 0 for i in stuck)
    assert len(stuck) <= 2 * 10  # only what was produced before the stall was noticed

    publisher.no_leader = None  # the leader is back
    for _ in range(40):
        pump.run_once()
        clock.now += 0.1
    assert not store.pending
    # Per key, first productions follow id order (the pump produced each key in order).
    first: dict[str, list[int]] = {}
    seen: set[int] = set()
    for i in publisher.sent:
        if i not in seen:
            seen.add(i)
            first.setdefault(f"k{i % KEYS}", []).append(i)
    for key, ids in first.items():
        assert ids == sorted(ids), (key, ids)
    assert metrics.registry.get_sample_value("outbox_relay_stalled_rows",
                                             {"topic": "t", "partition": "0"}) is None
