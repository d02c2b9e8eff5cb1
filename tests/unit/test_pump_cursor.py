"""The pump's cursor is only gapless for shards every claim since its start included.

A shard left out of a claim (being given back, lease briefly untrusted) has pending
rows behind the cursor; when it comes back, the pump must rewind before claiming it,
or the key's later rows go first.  Pure logic: the store, producer and leases are fakes.
"""

from __future__ import annotations

from relay.metrics import RelayMetrics
from relay.model import ShardId
from relay.pump import Pump
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row


def test_a_shard_that_comes_back_is_claimed_from_the_start() -> None:
    # Shard 1's key has rows 2 and 4; shard 0's rows 1 and 3.
    store = Store([row(1, 0), row(2, 1), row(3, 0), row(4, 1)])
    publisher, leases = Publisher(), Leases()
    pump = Pump(store=store, publisher=publisher, leases=leases, nshards=2, batch_size=1,  # type: ignore[arg-type]
                pipeline_depth=1, max_attempts=3, backoff_initial_s=0.1, backoff_max_s=1.0,
                metrics=RelayMetrics(), log=Log())
    pump.run_once()                        # claims row 1 (shard 0)
    leases.usable_shards = {ShardId(0)}    # shard 1 is being given back
    pump.run_once()                        # settles row 1; claims row 3: the cursor passes row 2
    assert publisher.sent == [1, 3]
    leases.usable_shards = {ShardId(0), ShardId(1)}  # kept after all
    for _ in range(6):
        pump.run_once()
    shard1 = [i for i in publisher.sent if i in (2, 4)]
    assert shard1 == [2, 4], publisher.sent
    assert not store.pending
