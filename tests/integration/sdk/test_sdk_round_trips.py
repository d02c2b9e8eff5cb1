"""Issue 19: what one message costs in round trips on the real PostgreSQL inbox.  One at a
time, a new message costs two (the previous message's COMMIT, BEGIN and its claim in one
simple query; the handler's statement) and a poll one more (its last COMMIT), and a
redelivered poll one lookup in all; a batch costs BEGIN with the claim, the batch handler's
savepoint and statement and COMMIT, whatever its size (before: a redelivered batch cost
BEGIN, the claim and COMMIT; a new message one at a time three, and four before that).  A
batch with a per-message handler costs one round trip per new message, plus BEGIN with the
claim and COMMIT (before: a savepoint per message too).  The
lookup is skipped while lookups find nothing (new messages), until a claim meets a duplicate."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import structlog

from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import InboxMessage, KafkaRecord
from consumer_sdk.processor import Policies, Processor
from consumer_sdk.store import PgInboxStore, connect_factory
from consumer_sdk.testing import FakeDeadLetters, make_record
from tests.integration.sdk._support import RoundTrips

EFFECTS = "CREATE TABLE IF NOT EXISTS rt_effects (event_id uuid NOT NULL, n int NOT NULL)"


def _processor(store: PgInboxStore, *, batch_size: int | None, batched: bool,
               settled: list[KafkaRecord]) -> Processor:
    def handler(conn: Any, message: InboxMessage) -> None:
        conn.execute("INSERT INTO rt_effects VALUES (%s, %s)", (message.event_id, message.json()["n"]))

    def batch_handler(conn: Any, messages: Sequence[InboxMessage]) -> None:
        conn.execute("INSERT INTO rt_effects SELECT * FROM unnest(%s::uuid[], %s::int[])",
                     ([m.event_id for m in messages], [m.json()["n"] for m in messages]))

    return Processor(consumer=f"rt-{uuid.uuid4().hex[:6]}", store=store,
                     handler=None if batched else handler, batch_handler=batch_handler if batched else None,
                     dead_letters=FakeDeadLetters(), policies=Policies(), metrics=ConsumerMetrics(),
                     log=structlog.get_logger("tests.sdk"), sleep=lambda s: None,
                     on_settled=settled.extend, batch_size=batch_size)


def _count(sdk_db: str, *, batch_size: int | None, batched: bool, n: int) -> tuple[int, int, int]:
    store = PgInboxStore(connect_factory(sdk_db))
    store.conn.execute(EFFECTS)
    settled: list[KafkaRecord] = []
    processor = _processor(store, batch_size=batch_size, batched=batched, settled=settled)
    records = [make_record(value={"n": i}, offset=i) for i in range(n)]
    # Six new messages first: the lookup finds nothing (skipped from now on), and psycopg has
    # prepared the statements it runs more than five times (preparing costs a round trip).
    warm = [make_record(value={"n": -i}, offset=i) for i in range(1, 7)]
    processor.process(warm)
    try:
        with RoundTrips(store.conn) as new:
            assert processor.process(records).applied == n
        processor.process(records[:1])  # a redelivery: its claim meets a duplicate; lookups again
        with RoundTrips(store.conn) as again:
            assert processor.process(records).duplicates == n
        effects = store.conn.execute("SELECT count(*) FROM rt_effects WHERE event_id = ANY(%s)",
                                     ([uuid.UUID(dict(r.headers)["event_id"].decode()) for r in records],)
                                     ).fetchone()
    finally:
        store.close()
    assert settled == warm + records + records[:1] + records and effects == (n,)
    return new.count, again.count, n


def test_one_message_at_a_time_costs_two_round_trips_and_a_redelivered_poll_one(sdk_db):
    new, again, n = _count(sdk_db, batch_size=1, batched=False, n=5)
    assert new == 2 * n + 1  # [COMMIT;] BEGIN; claim, then the handler, per message; the last COMMIT
    assert again == 1


def test_a_batch_costs_four_round_trips_whatever_its_size(sdk_db):
    new, again, _ = _count(sdk_db, batch_size=None, batched=True, n=50)
    assert new == 4  # BEGIN+claim, the batch handler's savepoint, its statement, COMMIT
    assert again == 1


def test_a_batch_with_a_per_message_handler_costs_one_round_trip_per_new_message(sdk_db):
    """No savepoint per message while nothing fails (before: a savepoint and the handler's
    statement each, 2n + 2)."""
    new, again, n = _count(sdk_db, batch_size=None, batched=False, n=20)
    assert new == n + 2  # BEGIN+claim, the handler's statement per message, COMMIT
    assert again == 1


def test_without_pipeline_mode_the_same_statements_go_one_by_one(sdk_db, monkeypatch):
    """libpq < 14 has no pipeline mode: a batch's BEGIN goes alone (one round trip more), same
    answers; one at a time needs no pipeline (a simple query carries COMMIT, BEGIN and the claim)."""
    monkeypatch.setattr(psycopg.capabilities, "has_pipeline", lambda check=False: False)
    new, again, _ = _count(sdk_db, batch_size=None, batched=True, n=20)
    assert new == 5 and again == 1
    new, again, n = _count(sdk_db, batch_size=1, batched=False, n=3)
    assert new == 2 * n + 1 and again == 1
