"""TransactionalPublisher's bookkeeping (issue 20) with a fake shard worker: callbacks run
inside poll, a failed transaction fails what was buffered after it until the pump rewinds,
a committed row claimed again is acknowledged without a second produce, a fenced
transaction loses its lease, and the position record lists unconfirmed rows."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

import relay.exactly_once as eo
from relay.exactly_once_position import PositionTopic
from relay.exactly_once_records import PositionTopicTooSmall
from relay.exactly_once_shard import Job, Position, Result, event_digest
from relay.model import Lease, OutboxRow, RowId, ShardId, Token
from relay.publisher import Outcome


class FakeWorker:
    made: list[FakeWorker] = []

    def __init__(self, shard: ShardId, token: Token, *, results: Any, **_: Any) -> None:
        self.shard, self.token, self.results = shard, token, results
        self.jobs: list[Job] = []
        self.closed = False
        FakeWorker.made.append(self)

    def submit(self, job: Job) -> None:
        self.jobs.append(job)

    def close(self) -> None:
        self.closed = True

    def join(self, timeout_s: float) -> None: ...

    def finish(self, *, ok: bool = True, fenced: bool = False, timed_out: bool = False) -> None:
        job = self.jobs[-1]
        rows = [row for row, _ in job.rows]
        outcome = Outcome(ok=ok, error_class="" if ok else "transaction_aborted")
        self.results.put(Result(self, rows=rows, callbacks=job.callbacks, ok=ok, fenced=fenced,  # type: ignore[arg-type]
                                timed_out=timed_out, broken=fenced,
                                outcomes={row.id: outcome for row in rows}, listed=dict(job.position)))

    @property
    def _thread(self) -> Any:
        return type("T", (), {"is_alive": lambda self: False})()


class Leases:
    owner = "me"

    def __init__(self) -> None:
        self.leases = {ShardId(0): Lease(ShardId(0), Token(7), 1e12)}
        self.lost: list[ShardId] = []
        self.untrusted: set[ShardId] = set()  # held, but past the local deadline

    def trusted(self, shard: ShardId, now: float) -> bool:
        return shard in self.leases and shard not in self.untrusted

    def lose(self, shards: Any, why: str) -> None:
        for shard in shards:
            self.leases.pop(shard, None)
            self.lost.append(shard)


class Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def row(i: int) -> OutboxRow:
    return OutboxRow(RowId(i), f"e{i}", "t", "k", b"{}", "{}", i, ShardId(0), 0, 0.0)


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> tuple[eo.TransactionalPublisher, Leases, list[tuple[int, bool, str]]]:
    FakeWorker.made = []
    monkeypatch.setattr(eo, "ShardWorker", FakeWorker)
    leases = Leases()
    publisher = eo.TransactionalPublisher(
        config={}, plain=type("P", (), {"poll": lambda self, t: 0})(), leases=leases,  # type: ignore[arg-type]
        table="outbox", position_topic="pos", transactional_id_prefix="x.",
        recovery_store=object(), log=Log())  # type: ignore[arg-type]
    seen: list[tuple[int, bool, str]] = []
    publisher.poll(0)  # the lease is seen: a worker starts
    worker = FakeWorker.made[0]
    worker.results.put(Result(worker, init=True, ok=True))  # type: ignore[arg-type]
    publisher.poll(0)
    assert publisher.ready(ShardId(0))
    return publisher, leases, seen


def cb(seen: list[tuple[int, bool, str]]) -> Any:
    return lambda r, o: seen.append((r.id, o.ok, o.error_class))


def test_rows_go_in_one_transaction_and_report_inside_poll(setup) -> None:
    publisher, _leases, seen = setup
    worker = FakeWorker.made[0]
    assert publisher.transactional_id(ShardId(0)) == "x.outbox.0"
    for i in (1, 2):
        assert publisher.send(row(i), cb(seen)) is None
    publisher.poll(0)
    assert [r.id for r, _ in worker.jobs[0].rows] == [1, 2]
    assert worker.jobs[0].position == [(1, event_digest("e1")), (2, event_digest("e2"))]
    worker.finish()
    assert seen == []  # never from the worker: only inside poll
    publisher.poll(0)
    assert seen == [(1, True, ""), (2, True, "")]
    # Not confirmed yet: the next position record still lists them.
    publisher.send(row(3), cb(seen))
    publisher.poll(0)
    assert [i for i, _ in worker.jobs[1].position] == [1, 2, 3]
    publisher.confirm_marked([RowId(1), RowId(2)])
    worker.finish()
    publisher.poll(0)
    publisher.send(row(4), cb(seen))
    publisher.poll(0)
    assert worker.jobs[2].position == [(3, event_digest("e3")), (4, event_digest("e4"))]


def test_a_committed_row_claimed_again_is_not_produced_again(setup) -> None:
    publisher, _leases, seen = setup
    worker = FakeWorker.made[0]
    publisher.send(row(1), cb(seen))
    publisher.poll(0)
    worker.finish()
    publisher.poll(0)
    publisher.send(row(1), cb(seen))  # its mark was lost: claimed again
    publisher.poll(0)
    assert len(worker.jobs) == 1
    assert seen == [(1, True, ""), (1, True, "")]
    # Another event under that id (a database restored from a backup hands ids out again):
    # produced, not taken for the committed one.
    other = row(1)._replace(event_id="e1-after-a-restore")
    publisher.send(other, cb(seen))
    publisher.poll(0)
    assert len(worker.jobs) == 2 and worker.jobs[1].rows[0][0] is other


def test_a_failed_transaction_fails_what_follows_until_the_rewind(setup) -> None:
    publisher, _leases, seen = setup
    worker = FakeWorker.made[0]
    publisher.send(row(1), cb(seen))
    publisher.poll(0)
    publisher.send(row(2), cb(seen))  # buffered behind the running transaction
    worker.finish(ok=False)
    publisher.poll(0)
    assert seen == [(1, False, "transaction_aborted"), (2, False, "earlier_transaction_failed")]
    publisher.send(row(3), cb(seen))
    publisher.poll(0)
    assert (3, False, "earlier_transaction_failed") in seen
    assert len(worker.jobs) == 1
    publisher.rewound()
    publisher.send(row(1), cb(seen))
    publisher.poll(0)
    assert len(worker.jobs) == 2


def test_a_fenced_transaction_loses_the_lease_and_closes_the_producer(setup) -> None:
    publisher, leases, seen = setup
    worker = FakeWorker.made[0]
    publisher.send(row(1), cb(seen))
    publisher.poll(0)
    worker.finish(ok=False, fenced=True)
    publisher.poll(0)
    assert leases.lost == [ShardId(0)]
    publisher.poll(0)
    assert worker.closed and not publisher.ready(ShardId(0))


@pytest.mark.parametrize("trusted", [True, False])
def test_a_transaction_that_timed_out_keeps_a_trusted_lease_and_recovers_in_place(
        setup, monkeypatch, trusted: bool) -> None:
    # The broker aborted it for transaction.timeout.ms (librdkafka: "fenced"): the lease was
    # given up all the same, and a lone replica's shard waited for its next heartbeat.
    publisher, leases, seen = setup
    monkeypatch.setattr(eo, "INIT_RETRY_INITIAL_S", 0.0)
    worker = FakeWorker.made[0]
    publisher.send(row(1), cb(seen))
    publisher.poll(0)
    if not trusted:  # paused past the lease: another replica may hold the shard by now
        leases.untrusted.add(ShardId(0))
    worker.finish(ok=False, fenced=True, timed_out=True)
    publisher.poll(0)
    assert seen == [(1, False, "transaction_aborted")]
    assert worker.closed and not publisher.ready(ShardId(0))
    publisher.poll(0)
    if not trusted:
        assert leases.lost == [ShardId(0)] and FakeWorker.made == [worker]
        return
    assert leases.lost == []
    successor = FakeWorker.made[-1]  # the same lease, a new producer: its init recovers
    assert successor is not worker and successor.token == Token(7)
    successor.results.put(Result(successor, init=True, ok=True))  # type: ignore[arg-type]
    publisher.poll(0)
    publisher.rewound()
    assert publisher.ready(ShardId(0))
    publisher.send(row(1), cb(seen))
    publisher.poll(0)
    assert [r.id for r, _ in successor.jobs[0].rows] == [1]


def test_stop_closes_every_worker_once(setup: Any) -> None:
    publisher, _leases, _seen = setup
    publisher.start()
    worker = FakeWorker.made[0]
    publisher.stop(1.0)
    assert worker.closed
    worker.closed = False
    publisher.stop(1.0)  # idempotent
    assert not worker.closed and not publisher._shards  # noqa: SLF001


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_shards_transactions_start_a_commit_interval_apart_unless_full(monkeypatch) -> None:
    # At a steady rate every claim brought each shard a row or two, and each went in a
    # transaction of its own as soon as the one before committed: at 1,000 events/s over
    # 16 shards, the relay spent 40 % of a core (issue 18's twenty-fourth pass).  Now rows
    # that come within the commit interval of the shard's last start wait for the next.
    FakeWorker.made = []
    monkeypatch.setattr(eo, "ShardWorker", FakeWorker)
    clock, seen = Clock(), []  # type: ignore[var-annotated]
    publisher = eo.TransactionalPublisher(
        config={}, plain=type("P", (), {"poll": lambda self, t: 0})(), leases=Leases(),  # type: ignore[arg-type]
        table="outbox", position_topic="pos", transactional_id_prefix="x.",
        recovery_store=object(), log=Log(), clock=clock, commit_interval_s=0.1)  # type: ignore[arg-type]
    publisher.poll(0)
    worker = FakeWorker.made[0]
    worker.results.put(Result(worker, init=True, ok=True))  # type: ignore[arg-type]
    publisher.poll(0)
    publisher.send(row(1), cb(seen))
    publisher.poll(0)
    assert len(worker.jobs) == 1  # the shard's first transaction goes at once
    worker.finish()
    clock.now += 0.03
    publisher.send(row(2), cb(seen))
    publisher.poll(0)
    assert seen == [(1, True, "")] and len(worker.jobs) == 1  # held back: 0.07 s to go
    began = time.monotonic()
    publisher.poll(5.0)  # nothing to serve: waits for results only until the held-back start
    assert time.monotonic() - began < 1.0
    clock.now += 0.07
    publisher.poll(0)
    assert [r.id for r, _ in worker.jobs[1].rows] == [2]
    worker.finish()
    publisher.poll(0)
    clock.now += 0.01  # within the interval, but a full transaction's worth goes at once
    for i in range(3, 3 + eo.FULL_TRANSACTION_ROWS):
        publisher.send(row(i), cb(seen))
    publisher.poll(0)
    assert len(worker.jobs[2].rows) == eo.FULL_TRANSACTION_ROWS


class FakeTxnProducer:
    """A transactional producer whose init_transactions only records its id in ``inits``."""

    inits: list[str] = []

    def __init__(self, config: Any) -> None:
        self.id = config["transactional.id"]

    def init_transactions(self, timeout: float) -> None:
        FakeTxnProducer.inits.append(self.id)

    def list_topics(self, timeout: float) -> Any:  # a connected broker answers
        return SimpleNamespace(orig_broker_id=1)

    def flush(self, timeout: float) -> int:
        return 0

    def __len__(self) -> int:  # nothing queued: its worker's end closes it (destroy_producer)
        return 0

    def close(self) -> None: ...


class FakeReader:
    """Reads in turn what ``script`` lists (each read first waits for ``gate``); the
    partition's end is ``ends`` in turn."""

    script: list[Position] = []
    ends: list[int] = []
    reads = 0
    gate = threading.Event()

    def __init__(self, config: Any, topic: str, shard: ShardId) -> None: ...

    def read(self) -> Position:
        assert FakeReader.gate.wait(10)
        FakeReader.reads += 1
        return FakeReader.script.pop(0)

    def end(self) -> int:
        return FakeReader.ends.pop(0)

    def close(self) -> None: ...


@pytest.fixture
def fake_worker_io(monkeypatch: pytest.MonkeyPatch) -> None:
    import relay.exactly_once_shard as shard_mod

    FakeTxnProducer.inits = []
    FakeReader.script, FakeReader.ends, FakeReader.reads = [], [], 0
    FakeReader.gate.set()
    monkeypatch.setattr(shard_mod, "Producer", FakeTxnProducer)
    monkeypatch.setattr(shard_mod, "PositionReader", FakeReader)


def test_a_worker_closed_while_it_reads_its_position_does_not_take_the_transactional_id(
        fake_worker_io: None) -> None:
    """A shard released (a replica joined) while its new worker read the position record:
    the worker went on to init_transactions, and so fenced the producer of the replica that
    took the shard meanwhile (a rolling restart on Apache Kafka: that replica's transaction
    failed and it had the shard back 3 s later)."""
    import relay.exactly_once_shard as shard_mod

    FakeReader.script = [Position([], None, 0)]
    FakeReader.gate.clear()
    results: Any = __import__("queue").SimpleQueue()
    worker = shard_mod.ShardWorker(ShardId(3), Token(1), config={}, transactional_id="x.outbox.3",
                                   position_topic="pos", recover=lambda *a: None,
                                   results=results, outbox="9f2a-this/outbox")
    worker.close()  # released while the read is under way
    FakeReader.gate.set()
    result = results.get(timeout=10)
    worker.join(10)
    assert result.init and not result.ok and FakeReader.reads == 1
    assert FakeTxnProducer.inits == []


def test_the_position_reader_asks_again_while_the_partition_has_no_leader(monkeypatch) -> None:
    """A position topic just created answers "not leader for partition" for a moment: every
    shard's first init failed with it and waited 0.5 s (16 warnings at each start of a
    rolling bench run).  The reader asks again until its timeout; other errors raise."""
    from confluent_kafka import KafkaError, KafkaException

    import relay.exactly_once_position as position_mod

    answers: list[Any] = []

    class FakeConsumer:
        def __init__(self, config: Any) -> None: ...

        def get_watermark_offsets(self, tp: Any, timeout: float, cached: bool) -> tuple[int, int]:
            answer = answers.pop(0)
            if isinstance(answer, int):
                raise KafkaException(KafkaError(answer))
            return answer

        def close(self) -> None: ...

    monkeypatch.setattr(position_mod, "Consumer", FakeConsumer)
    monkeypatch.setattr(position_mod, "OFFSETS_RETRY_S", 0.001)
    reader = position_mod.PositionReader({}, "pos", ShardId(0), timeout_s=5)
    answers[:] = [KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, (0, 7)]
    assert reader.end() == 7 and answers == []
    answers[:] = [KafkaError.TOPIC_AUTHORIZATION_FAILED]
    with pytest.raises(KafkaException):
        reader.end()


def test_another_outboxs_position_record_stops_the_relay_and_marks_nothing(
        fake_worker_io: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker side: a position record naming another outbox is refused before recovery,
    # and, when it is there before this worker takes the transactional id, before
    # init_transactions: the other outbox's producer is not fenced.
    import relay.exactly_once_shard as shard_mod

    inits = FakeTxnProducer.inits

    recovered: list[Any] = []
    results: Any = __import__("queue").SimpleQueue()

    def init(script: list[Position], ends: list[int]) -> Result:
        FakeReader.script, FakeReader.ends, FakeReader.reads = script, ends, 0
        worker = shard_mod.ShardWorker(ShardId(3), Token(1), config={}, transactional_id="x.outbox.3",
                                       position_topic="pos", recover=lambda *a: recovered.append(a),
                                       results=results, outbox="9f2a-this/outbox")
        result: Result = results.get(timeout=10)
        worker.close()
        worker.join(10)
        return result

    result = init([Position([RowId(1), RowId(2)], "1b0c-other/outbox", 7)], [])
    assert result.init and result.foreign and not result.ok and recovered == []
    assert inits == []  # refused before taking the transactional id: nobody fenced
    assert "written by another outbox (1b0c-other/outbox, this one is 9f2a-this/outbox)" in result.error
    assert "pos[3]" in result.error
    # A record of this outbox, or of a relay from before migration 0013, is recovered; read
    # once when the partition's end did not move across init_transactions.
    for writer in ("9f2a-this/outbox", None):
        assert init([Position([RowId(5)], writer, 7)], [7]).ok
        assert FakeReader.reads == 1
    assert [ids for _shard, _token, ids, _events in recovered] == [[5], [5]]
    assert inits == ["x.outbox.3"] * 2
    # The end moved (the previous holder's open transaction aborted or committed): read again.
    assert init([Position([RowId(5)], None, 7), Position([RowId(6)], "9f2a-this/outbox", 9)], [9]).ok
    assert FakeReader.reads == 2 and recovered[-1][2] == [6]
    # Another outbox's record written in between (two new outboxes sharing the defaults).
    result = init([Position([], None, 0), Position([RowId(8)], "1b0c-other/outbox", 2)], [2])
    assert result.foreign and not result.ok and len(recovered) == 3

    # The publisher side: the relay is told to stop, and the shard is not tried again (each
    # try would fence the other outbox's producer).
    FakeWorker.made = []
    monkeypatch.setattr(eo, "ShardWorker", FakeWorker)
    fatal: list[str] = []
    publisher = eo.TransactionalPublisher(
        config={}, plain=type("P", (), {"poll": lambda self, t: 0})(), leases=Leases(),  # type: ignore[arg-type]
        table="outbox", position_topic="pos", transactional_id_prefix="x.",
        recovery_store=object(), log=Log(), outbox="9f2a-this/outbox", on_fatal=fatal.append)  # type: ignore[arg-type]
    publisher.poll(0)
    first = FakeWorker.made[0]
    first.results.put(Result(first, init=True, broken=True, foreign=True, error="another outbox"))  # type: ignore[arg-type]
    publisher.poll(0)
    publisher.poll(0)
    assert fatal == ["another outbox"]
    assert first.closed and len(FakeWorker.made) == 1 and not publisher.ready(ShardId(0))


class RecordingLog:
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **_: self.events.append(event)


@pytest.mark.parametrize("created", [False, True])
def test_a_position_partition_not_found_is_called_a_missing_topic_only_when_created_again(
        monkeypatch, created: bool) -> None:
    # A position partition without a leader reads as one not found (the errors of a deleted
    # topic): the relay logged exactly_once_position_topic_missing "created again", at error
    # level, though the topic was there and nothing was created.
    FakeWorker.made = []
    monkeypatch.setattr(eo, "ShardWorker", FakeWorker)
    made: list[str] = []
    monkeypatch.setattr(eo, "ensure_position_topic",
                        lambda config, topic, n: made.append(topic) or PositionTopic(created, 1_000_000))
    log = RecordingLog()
    publisher = eo.TransactionalPublisher(
        config={}, plain=type("P", (), {"poll": lambda self, t: 0})(), leases=Leases(),  # type: ignore[arg-type]
        table="outbox", position_topic="pos", transactional_id_prefix="x.",
        recovery_store=object(), log=log, nshards=16)  # type: ignore[arg-type]
    publisher.poll(0)
    worker = FakeWorker.made[0]
    worker.results.put(Result(worker, init=True, broken=True, position_missing=True,  # type: ignore[arg-type]
                              error="Failed to get watermark offsets: Local: Unknown partition"))
    publisher.poll(0)
    assert made == ["pos"]  # asked to make sure it is there
    assert ("exactly_once_position_topic_missing" in log.events) is created
    assert "exactly_once_shard_init_failed" in log.events


@pytest.mark.parametrize("created", [False, True])
def test_a_position_topic_found_too_small_for_one_row_stops_the_relay(monkeypatch, created: bool) -> None:
    # A position topic deleted and created again by the relay with a record size limit below
    # one row's position record: it was logged exactly_once_position_topic_not_created (it had
    # been created) and the relay went on, every transaction refused.  Now it stops with the
    # limit's message, as at start, and says the topic was created again when it was.
    FakeWorker.made = []
    monkeypatch.setattr(eo, "ShardWorker", FakeWorker)
    too_small = "exactly-once: the position topic pos takes records of at most 100 bytes"

    def ensure(config: Any, topic: str, n: int) -> PositionTopic:
        raise PositionTopicTooSmall(too_small, created=created)

    monkeypatch.setattr(eo, "ensure_position_topic", ensure)
    log, fatal = RecordingLog(), []
    publisher = eo.TransactionalPublisher(
        config={}, plain=type("P", (), {"poll": lambda self, t: 0})(), leases=Leases(),  # type: ignore[arg-type]
        table="outbox", position_topic="pos", transactional_id_prefix="x.",
        recovery_store=object(), log=log, nshards=16, on_fatal=fatal.append)  # type: ignore[arg-type]
    publisher.poll(0)
    worker = FakeWorker.made[0]
    worker.results.put(Result(worker, init=True, broken=True, position_missing=True,  # type: ignore[arg-type]
                              error="Failed to get watermark offsets: Local: Unknown partition"))
    publisher.poll(0)
    assert fatal == [too_small]
    assert "exactly_once_position_topic_not_created" not in log.events
    assert ("exactly_once_position_topic_missing" in log.events) is created
