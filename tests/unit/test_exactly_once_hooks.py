"""The pump's three optional hooks for exactly-once mode (issue 20), with fakes: a shard
is claimed only once its publisher says it is ready (recovered), marks are confirmed to the
publisher, and a rewind is announced.  Without the hooks nothing changes."""

from __future__ import annotations

from typing import Any

from relay.metrics import RelayMetrics
from relay.model import RowId, ShardId
from relay.pump import Pump
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row


class HookedPublisher(Publisher):
    def __init__(self) -> None:
        super().__init__()
        self.ready_shards = {ShardId(0)}
        self.confirmed: list[RowId] = []
        self.rewinds = 0

    def ready(self, shard: ShardId) -> bool:
        return shard in self.ready_shards

    def confirm_marked(self, ids: Any) -> None:
        self.confirmed.extend(ids)

    def rewound(self) -> None:
        self.rewinds += 1


def _pump(store: Store, publisher: Publisher) -> Pump:
    return Pump(store=store, publisher=publisher, leases=Leases(), nshards=2, batch_size=10,  # type: ignore[arg-type]
                pipeline_depth=1, max_attempts=3, backoff_initial_s=0.1, backoff_max_s=1.0,
                metrics=RelayMetrics(), log=Log())


def test_a_shard_is_claimed_only_when_its_publisher_is_ready() -> None:
    store = Store([row(1, 0), row(2, 1), row(3, 0), row(4, 1)])
    publisher = HookedPublisher()
    pump = _pump(store, publisher)
    for _ in range(4):
        pump.run_once()
    assert publisher.sent == [1, 3]  # shard 1 is still recovering
    assert set(store.pending) == {2, 4}
    rewinds = publisher.rewinds
    publisher.ready_shards.add(ShardId(1))
    for _ in range(6):
        pump.run_once()
    assert publisher.sent == [1, 3, 2, 4]
    assert publisher.rewinds > rewinds  # the shard came back through a rewind
    assert sorted(publisher.confirmed) == [1, 2, 3, 4]
    assert not store.pending


def test_without_hooks_every_usable_shard_is_claimed() -> None:
    store = Store([row(1, 0), row(2, 1)])
    publisher = Publisher()
    pump = _pump(store, publisher)
    for _ in range(3):
        pump.run_once()
    assert publisher.sent == [1, 2]
    assert not store.pending


def test_exactly_once_options_have_defaults_and_parse() -> None:
    from relay.config import build_settings

    base = {"dsn": "postgresql://u@127.0.0.1/db", "bootstrap_servers": "127.0.0.1:9092"}
    plain = build_settings(base)
    assert plain.exactly_once is False
    assert plain.exactly_once_position_topic == "outbox-relay.positions"
    assert plain.exactly_once_transactional_id_prefix == "outbox-relay."
    assert plain.exactly_once_pipeline_depth == 16 and plain.pipeline_depth == 4
    eo = build_settings({**base, "exactly_once": "true", "exactly_once_position_topic": "p"})
    assert eo.exactly_once is True and eo.exactly_once_position_topic == "p"
