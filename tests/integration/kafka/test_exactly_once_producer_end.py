"""The end of an exactly-once shard worker's transactional producer (Apache Kafka behind a
fault proxy): its librdkafka threads are gone when its worker ends, and so are the rows its
messages' delivery callbacks held.

A worker whose commit timed out (the broker unreachable) ended its producer with
``flush(0)`` and a dropped reference: the client was destroyed, but the reports of the
messages it still held were never served, and their callbacks kept every row of the
transaction, payload and all, for the life of the process.  Its producer ends now with
the reports served; an idle one with ``destroy_producer``.  The worker's recovery hook
(the relay marks rows in its database there) only records what it was handed: the
position the next worker read back is checked, the database is not part of this test."""

from __future__ import annotations

import gc
import queue
import sys
from collections.abc import Callable, Iterator

import pytest

import relay.exactly_once_shard as shard_module
from relay.exactly_once_shard import Job, Result, ShardWorker, ensure_position_topic
from relay.model import OutboxRow, RowId, ShardId, Token
from tests.fixtures.broker import Broker, create_topic, read_all
from tests.fixtures.procs import rdkafka_threads, wait_until
from tests.fixtures.proxy import TcpProxy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

COMMIT_TIMEOUT_S = 3.0  # the worker's commit gives up this soon on the cut-off broker


@pytest.fixture
def no_cyclic_collection() -> Iterator[None]:
    """What ends a client is the code, not the collector's timing."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _rows(topic: str, first: int, count: int) -> list[OutboxRow]:
    return [OutboxRow(RowId(i), f"00000000-0000-7000-8000-{i:012d}", topic, f"k{i % 7}", b"v" * 1000,
                      "{}", 1, ShardId(0), 0, 0.0) for i in range(first, first + count)]


def _job(rows: list[OutboxRow]) -> Job:
    return Job(rows=[(row, [("event_id", row.event_id)]) for row in rows],
               position=[(row.id, shard_module.event_digest(row.event_id)) for row in rows],
               callbacks={row.id: None for row in rows})


def test_an_ended_shard_producer_leaves_no_threads_and_holds_no_rows(
        proxied_kafka: tuple[Broker, TcpProxy], topic_name: Callable[[str], str],
        no_cyclic_collection: None, monkeypatch: pytest.MonkeyPatch) -> None:
    broker, proxy = proxied_kafka
    monkeypatch.setattr(shard_module, "COMMIT_TIMEOUT_S", COMMIT_TIMEOUT_S)
    topic, position_topic, txn = topic_name("eo-end"), topic_name("pos"), topic_name("txn")
    config = {"bootstrap.servers": broker.bootstrap, "transaction.timeout.ms": "60000"}
    create_topic(broker.bootstrap, topic, partitions=2)
    ensure_position_topic(config, position_topic, 1)
    before = rdkafka_threads()
    recovered: list[list[RowId]] = []
    results: queue.SimpleQueue[Result] = queue.SimpleQueue()

    def worker(token: int) -> ShardWorker:
        return ShardWorker(ShardId(0), Token(token), config=config, transactional_id=f"{txn}.0",
                           position_topic=position_topic, outbox="o", results=results,
                           recover=lambda shard, token, ids, events: recovered.append(ids))

    first = worker(1)
    assert results.get(timeout=60).ok
    committed = _rows(topic, 1, 5)
    first.submit(_job(committed))
    assert results.get(timeout=60).ok

    proxy.blackhole()  # the next transaction's commit never gets an answer
    stranded = _rows(topic, 100, 200)
    baseline = [sys.getrefcount(row) for row in stranded]
    first.submit(_job(stranded))
    result = results.get(timeout=60)
    assert not result.ok and result.broken, result.error
    del result
    first.join(30)
    assert not first._thread.is_alive()  # noqa: SLF001
    wait_until(lambda: rdkafka_threads() == before, timeout_s=10,
               message=lambda: f"{rdkafka_threads() - before} librdkafka threads left by the ended producer")
    # Before: each row one reference more, its delivery callback's, never served.
    assert [sys.getrefcount(row) for row in stranded] == baseline

    proxy.restore()
    second = worker(2)  # init_transactions settles the first one's stranded transaction
    assert results.get(timeout=60).ok
    assert recovered == [[], [row.id for row in committed]]
    last = _rows(topic, 1000, 5)
    second.submit(_job(last))
    assert results.get(timeout=60).ok
    second.close()
    second.join(30)
    assert not second._thread.is_alive()  # noqa: SLF001
    wait_until(lambda: rdkafka_threads() == before, timeout_s=10,
               message=lambda: f"{rdkafka_threads() - before} librdkafka threads left by the closed worker")
    expected = {row.event_id for row in committed + last}
    records = read_all(broker.bootstrap, topic, expected=expected, timeout_s=30, extra_wait_s=1)
    # The stranded transaction's 200 rows: aborted, never visible to read_committed.
    assert sorted(r.headers["event_id"].decode() for r in records) == sorted(expected)
