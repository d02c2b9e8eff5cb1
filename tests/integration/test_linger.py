"""A caught-up relay's rows do not wait for the Kafka client's ``linger.ms`` (README,
"Configuration", the Kafka properties).

The relay's default ``linger.ms`` is 5 (issue 18's twenty-seventh pass): in a backlog the
client then fills fuller record batches, fewer requests for the same rows. A row written
while the relay is caught up must not pay it: after a paced claim the pump waits for the
rows' reports with the client's flush, and librdkafka's flush sends what is queued at once,
whatever ``linger.ms`` says. Here ``linger.ms`` is 3 s, so a row that waited for it would be
marked 3 s after its commit at the earliest.
"""

from __future__ import annotations

import psycopg

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    wait_drained,
)

LINGER_MS = 3000


def test_a_caught_up_relays_rows_go_without_waiting_for_linger(outbox_db, broker, topic):
    with RelayThread(outbox_db, broker.bootstrap, kafka_properties={"linger.ms": str(LINGER_MS)}):
        for n in range(6):  # one row a transaction, each once the relay has caught up
            insert_rows(outbox_db, topic, 1, keys=3, start=n)
            wait_drained(outbox_db, timeout_s=30)  # the first: connected, its producer id asked for
    written = all_event_ids(outbox_db)
    # Commit to mark on the database's clock (created_at is the insert's, published_at the
    # mark's, after the broker's acknowledgement), the first row left out.
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        lags = [r[0] for r in conn.execute(
            "SELECT extract(epoch FROM published_at - created_at)::float8 FROM outbox ORDER BY id OFFSET 1")]
    print("commit -> mark (s):", ", ".join(f"{lag:.3f}" for lag in lags))
    assert len(lags) == 5
    assert max(lags) < LINGER_MS / 1000 / 3, f"rows waited for linger.ms: {lags}"
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=written, timeout_s=30), written)
    assert delivery.missing == set() and delivery.order_violations == [] and delivery.duplicates == 0
