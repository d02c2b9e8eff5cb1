"""Exactly-once mode's position records and their size limit (relay/exactly_once_records.py):
a position too large for one record is written in parts that each fit and read back whole;
the topic's limit is read at start (too small for one row: ConfigError); a record the broker
refuses as too large makes the publisher cut the next ones to half, said once per cut."""

from __future__ import annotations

import json
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

import relay.exactly_once as eo
from relay.errors import ConfigError
from relay.exactly_once_position import PositionTopic
from relay.exactly_once_records import (
    RECORD_OVERHEAD_BYTES,
    encode_position,
    merge_parts,
    parts_named,
    read_record_limit,
    smallest_limit_bytes,
)
from relay.exactly_once_shard import Result
from relay.model import ShardId
from relay.outcomes import Outcome
from tests.unit.test_exactly_once_publisher import FakeWorker, Leases, row

OUTBOX = "0190f3c1-7a5e-7c3b-9d2a-5b8e4f6a1c2d/outbox"  # migration 0013's id and the table
WORST = [(10**19 - 1 - i, 2**48 - 1) for i in range(20_000)]  # 19-digit ids, 15-digit digests


def _read_back(records: list[bytes]) -> dict[str, Any]:
    """What recovery makes of them (relay.exactly_once_position.PositionReader.read)."""
    assert parts_named(records[-1]) == len(records) - 1
    return merge_parts(json.loads(records[-1]), list(records[:-1]))


def test_the_worst_case_record_of_a_full_transaction_is_760_kb() -> None:
    """20,000 rows (MAX_ROWS_PER_TRANSACTION) with 19-digit ids: one record of 760,108
    bytes, under the default 1 MB but over any topic limit below it."""
    records = encode_position(WORST, token=2**63 - 1, outbox=OUTBOX, limit_bytes=1_000_000)
    assert [len(r) for r in records] == [760_108]
    assert "parts" not in json.loads(records[0])  # one record: written as before


@pytest.mark.parametrize("limit", [20_000, 2_000, smallest_limit_bytes(OUTBOX)])
def test_a_position_over_the_limit_is_written_in_parts_that_fit_and_read_back_whole(limit: int) -> None:
    records = encode_position(WORST[:3_000], token=7, outbox=OUTBOX, limit_bytes=limit)
    assert len(records) > 1
    assert max(map(len, records)) <= limit - RECORD_OVERHEAD_BYTES
    whole = _read_back(records)
    assert list(zip(whole["ids"], whole["events"], strict=True)) == WORST[:3_000]
    assert whole["token"] == 7 and whole["outbox"] == OUTBOX


def test_a_limit_that_takes_no_row_is_refused() -> None:
    with pytest.raises(ValueError, match="one row"):
        encode_position(WORST[:2], token=7, outbox=OUTBOX, limit_bytes=smallest_limit_bytes(OUTBOX) - 200)


def test_parts_of_another_transaction_or_missing_ones_are_not_taken() -> None:
    first = encode_position(WORST[:300], token=7, outbox=OUTBOX, limit_bytes=2_000)
    second = encode_position(WORST[300:600], token=7, outbox=OUTBOX, limit_bytes=2_000)
    with pytest.raises(ValueError, match="not of this record's transaction"):
        merge_parts(json.loads(second[-1]), first[:-1])
    with pytest.raises(ValueError, match="found before it"):
        merge_parts(json.loads(second[-1]), second[1:-1])


class FakeAdmin:
    """describe_configs answers the topic's max.message.bytes."""

    def __init__(self, value: str) -> None:
        self.value = value

    def describe_configs(self, resources: list[Any]) -> dict[Any, Future[Any]]:
        future: Future[Any] = Future()
        future.set_result({"max.message.bytes": SimpleNamespace(value=self.value)})
        return {resources[0]: future}


def test_the_topics_limit_is_read_at_start_and_the_smaller_one_kept() -> None:
    config = {"bootstrap.servers": "b:9092"}
    assert read_record_limit(FakeAdmin("20000"), config, "pos-a", 1.0) == 20_000  # type: ignore[arg-type]
    smaller = {**config, "message.max.bytes": "15000"}
    assert read_record_limit(FakeAdmin("20000"), smaller, "pos-b", 1.0) == 15_000  # type: ignore[arg-type]


def test_a_topic_that_takes_no_record_of_one_row_stops_the_relay_at_start() -> None:
    with pytest.raises(ConfigError) as raised:
        read_record_limit(FakeAdmin("300"), {}, "pos-tiny", 1.0)  # type: ignore[arg-type]
    assert "pos-tiny" in str(raised.value) and "max.message.bytes" in str(raised.value)


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append((event, kw))


def _publisher(monkeypatch: pytest.MonkeyPatch, log: Log, fatal: list[str],
               record_limit_bytes: int | None = None) -> eo.TransactionalPublisher:
    FakeWorker.made = []
    monkeypatch.setattr(eo, "ShardWorker", FakeWorker)
    publisher = eo.TransactionalPublisher(
        config={}, plain=SimpleNamespace(poll=lambda t: 0), leases=Leases(),  # type: ignore[arg-type]
        table="outbox", position_topic="pos", transactional_id_prefix="x.", outbox="o",
        recovery_store=object(), log=log, on_fatal=fatal.append, nshards=1,  # type: ignore[arg-type]
        record_limit_bytes=record_limit_bytes)
    publisher.poll(0)
    FakeWorker.made[0].results.put(Result(FakeWorker.made[0], init=True, ok=True))  # type: ignore[arg-type]
    publisher.poll(0)
    return publisher


def _refused_transaction(publisher: eo.TransactionalPublisher, i: int, refused: list[int]) -> int:
    """A transaction whose position record the broker refused: the next job's limit."""
    worker = FakeWorker.made[-1]
    publisher.send(row(i), lambda r, o: None)
    publisher.poll(0)
    job = worker.jobs[-1]
    rows = [r for r, _ in job.rows]
    worker.results.put(Result(worker, rows=rows, callbacks=job.callbacks, position_refused=refused,  # type: ignore[arg-type]
                              outcomes={r.id: Outcome(ok=False, error_class="transaction_aborted")
                                        for r in rows}))
    publisher.poll(0)
    publisher.rewound()
    publisher.send(row(i + 1000), lambda r, o: None)
    publisher.poll(0)
    worker.finish()  # the next one went out, cut to this size, and committed
    publisher.poll(0)
    return worker.jobs[-1].limit_bytes


def test_a_refused_record_halves_the_next_ones_said_once_per_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retried as it was, the same record was refused for ever: the shard stalled."""
    log, fatal = Log(), []
    publisher = _publisher(monkeypatch, log, fatal)
    assert FakeWorker.made[0].jobs == [] and publisher.ready(ShardId(0))
    assert _refused_transaction(publisher, 1, [30_000]) == (30_000 + RECORD_OVERHEAD_BYTES) // 2
    # One encoded before that cut, refused later: no second cut.
    assert _refused_transaction(publisher, 2, [30_000]) == (30_000 + RECORD_OVERHEAD_BYTES) // 2
    cuts = [kw for event, kw in log.events if event == "exactly_once_position_record_too_large"]
    assert len(cuts) == 1 and "max.message.bytes" in cuts[0]["hint"] and fatal == []


def test_when_not_even_one_row_fits_the_relay_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    log, fatal = Log(), []
    publisher = _publisher(monkeypatch, log, fatal)
    floor = smallest_limit_bytes("o")
    limit, i = 1_000_000, 1
    while limit > floor:
        limit = _refused_transaction(publisher, i, [limit - RECORD_OVERHEAD_BYTES])
        i += 1
        assert limit >= floor and not fatal
    _refused_transaction(publisher, i, [floor - RECORD_OVERHEAD_BYTES])
    assert len(fatal) == 1 and "pos" in fatal[0] and "max.message.bytes" in fatal[0]


def test_a_producer_limit_that_takes_no_record_of_one_row_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="message.max.bytes"):
        eo.TransactionalPublisher(
            config={"message.max.bytes": "1000"}, plain=SimpleNamespace(), leases=Leases(),  # type: ignore[arg-type]
            table="outbox", position_topic="pos-producer-limit", transactional_id_prefix="x.",
            outbox="o" * 400, recovery_store=object(), log=Log())  # type: ignore[arg-type]


def _next_job_limit(publisher: eo.TransactionalPublisher, i: int) -> int:
    """The limit the shard's worker is handed with the next transaction's job."""
    worker = FakeWorker.made[-1]
    publisher.send(row(i), lambda r, o: None)
    publisher.poll(0)
    worker.finish()
    publisher.poll(0)
    return worker.jobs[-1].limit_bytes


def test_each_publisher_writes_at_the_limit_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit prepare() read is the publisher's own: two relays in one process (same
    bootstrap, same position topic) shared one module-level value, which nothing reset."""
    first = _publisher(monkeypatch, Log(), [], record_limit_bytes=20_000)
    assert first.record_limit_bytes == 20_000 and _next_job_limit(first, 1) == 20_000
    second = _publisher(monkeypatch, Log(), [], record_limit_bytes=50_000)
    assert _next_job_limit(second, 2) == 50_000
    third = _publisher(monkeypatch, Log(), [])  # none given: the producer's message.max.bytes
    assert _next_job_limit(third, 3) == 1_000_000


def test_a_position_topic_created_again_sets_the_next_records_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    publisher = _publisher(monkeypatch, log, [], record_limit_bytes=20_000)
    monkeypatch.setattr(eo, "ensure_position_topic", lambda config, topic, n: PositionTopic(True, 70_000))
    FakeWorker.made[-1].results.put(Result(FakeWorker.made[-1], init=True, broken=True,  # type: ignore[arg-type]
                                           position_missing=True, error="Unknown partition"))
    publisher.poll(0)  # the shard's producer is replaced, the topic created again
    assert publisher.record_limit_bytes == 70_000
    assert "exactly_once_position_topic_missing" in [event for event, _ in log.events]
