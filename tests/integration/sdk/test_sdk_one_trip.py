"""Issue 19: a statements handler (``statements=``) on the real PostgreSQL inbox and broker.
One message at a time, the inbox row, the handler's statements and the COMMIT go in one
round trip (a handler costs two); a duplicate, a failing statement or a failing COMMIT
writes nothing there and the message goes the handler's way, which applies the policies.
In a batch, the statements of all its new messages go in one round trip (a handler costs
one a message); when one fails, the batch goes one message at a time, as after a failing
batch handler."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from typing import Any

import psycopg
import pytest
import structlog

from consumer_sdk import InboxMessage, RetryPolicy
from consumer_sdk.errors import DatabaseUnavailable, FatalError
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import KafkaRecord
from consumer_sdk.processor import Policies, Processor
from consumer_sdk.replays import ReplayingInbox
from consumer_sdk.store import CLAIM_STRICT_STATEMENT, PgInboxStore, connect_factory
from consumer_sdk.testing import FakeDeadLetters, make_record
from tests.fixtures.broker import read_all
from tests.integration.sdk._support import (
    RoundTrips,
    effect_counts,
    make_config,
    publish_all,
    wait_settled,
    write_numbered,
)

EFFECTS = ("CREATE TABLE IF NOT EXISTS ot_effects (event_id uuid NOT NULL, n int NOT NULL, "
           "CHECK (n <> 13), "
           "CONSTRAINT ot_deferred UNIQUE (n) DEFERRABLE INITIALLY DEFERRED)")


def _statements(message: InboxMessage) -> list[tuple[Any, Any]]:
    n = message.json()["n"]
    return [("INSERT INTO ot_effects VALUES (%s, %s)", (message.event_id, n))]


class _Setup:
    def __init__(self, dsn: str, statements: Any = _statements, retry: RetryPolicy | None = None,
                 batch_size: int = 1) -> None:
        self.store = PgInboxStore(connect_factory(dsn))
        self.store.conn.execute(EFFECTS)
        self.settled: list[KafkaRecord] = []
        self.letters = FakeDeadLetters()
        self.calls: Counter[int] = Counter()
        self.consumer = f"ot-{uuid.uuid4().hex[:6]}"

        def counted(message: InboxMessage) -> Any:
            self.calls[message.json()["n"]] += 1
            return statements(message)

        self.processor = Processor(
            consumer=self.consumer, store=self.store, handler=None, statements=counted,
            dead_letters=self.letters, policies=Policies(retry=retry or RetryPolicy(max_attempts=1)),
            metrics=ConsumerMetrics(), log=structlog.get_logger("tests.sdk"), sleep=lambda s: None,
            on_settled=self.settled.extend, batch_size=batch_size)

    def effects(self) -> dict[int, int]:
        rows = self.store.conn.execute("SELECT n, count(*) FROM ot_effects GROUP BY n").fetchall()
        return {int(n): int(c) for n, c in rows}

    def inbox_rows(self) -> int:
        row = self.store.conn.execute("SELECT count(*) FROM outbox_inbox WHERE consumer = %s",
                                      (self.consumer,)).fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
def setup(sdk_db: str) -> Any:
    made: list[_Setup] = []

    def make(**kwargs: Any) -> _Setup:
        made.append(_Setup(sdk_db, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.store.conn.execute("DROP TABLE IF EXISTS ot_effects")
        s.store.close()


def test_one_message_at_a_time_costs_one_round_trip_and_commits(setup):
    s = setup()
    s.processor.process([make_record(value={"n": -i}, offset=i) for i in range(1, 4)])  # warm
    records = [make_record(value={"n": i}, offset=10 + i) for i in range(5)]
    with RoundTrips(s.store.conn) as trips:
        result = s.processor.process(records)
    assert result.applied == 5 and s.settled[-5:] == records
    assert trips.count == 5  # BEGIN, the inbox row, the statement, COMMIT: one Sync a message
    assert not [sent for sent in trips.sent if "outbox_inbox" in sent]  # the prepared claim_strict
    assert s.effects() == {n: 1 for n in [-1, -2, -3, 0, 1, 2, 3, 4]}
    assert s.inbox_rows() == 8
    assert s.store.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_redelivered_message_is_dropped_and_applied_once(setup):
    s = setup()
    records = [make_record(value={"n": i}, offset=i) for i in range(4)]
    s.processor.process(records)
    again = s.processor.process(records[:1])  # the one trip meets the inbox row: nothing written
    assert again.duplicates == 1 and again.applied == 0
    assert s.processor.process(records).duplicates == 4  # then the lookup before the poll finds them
    assert s.effects() == {0: 1, 1: 1, 2: 1, 3: 1}
    assert s.settled == records + records[:1] + records


def test_a_reused_event_id_with_another_body_is_a_mismatch_and_dead_lettered(setup):
    s = setup()
    event_id = uuid.uuid4()
    s.processor.process([make_record(value={"n": 1}, event_id=event_id, offset=0)])
    result = s.processor.process([make_record(value={"n": 2}, event_id=event_id, offset=1)])
    assert result.applied == 0
    assert [letter.reason for letter in s.letters.letters] == ["payload_mismatch"]
    assert s.effects() == {1: 1}


def test_a_failing_statement_writes_nothing_and_goes_to_the_policies(setup):
    s = setup(retry=RetryPolicy(max_attempts=2, backoff_initial_s=0.01))
    records = [make_record(value={"n": n}, offset=i) for i, n in enumerate([12, 13, 14])]
    result = s.processor.process(records)
    assert result.applied == 2 and result.dead_lettered == 1
    (letter,) = s.letters.letters
    assert letter.reason == "retries_exhausted" and letter.attempts == 2
    assert "ot_effects_n_check" in letter.error and letter.error_type == "CheckViolation"
    assert s.effects() == {12: 1, 14: 1}
    assert s.inbox_rows() == 2  # the failing event's row never committed
    assert s.calls[13] == 3  # the one trip, then two attempts the handler's way
    assert s.settled == records


def test_a_commit_that_fails_writes_nothing_and_fails_as_a_handlers_would(setup):
    """A deferred constraint fails at COMMIT, after every statement went through: nothing of the
    trip is written, and the handler's way meets the same COMMIT error (a FatalError, not a
    handler failure: the consumer stops there, the message unsettled)."""
    s = setup()
    first = make_record(value={"n": 7}, offset=0)
    same_n = make_record(value={"n": 7}, offset=1)  # another event, the same n: the deferred UNIQUE
    with pytest.raises(FatalError, match="ot_deferred"):
        s.processor.process([first, same_n])
    assert s.settled == [first]
    assert s.calls[7] == 3  # the first message's trip; the second's trip, then the handler's way
    assert s.effects() == {7: 1} and s.inbox_rows() == 1


def test_a_statements_handler_that_raises_or_answers_wrongly_goes_to_the_policies(setup):
    def statements(message: InboxMessage) -> Any:
        n = message.json()["n"]
        if n == 1:
            raise ValueError("no statement for one")
        if n == 2:
            return "INSERT INTO ot_effects VALUES (1, 2)"  # a string, not a list of pairs
        if n == 3:
            return [("INSERT INTO ot_effects VALUES (%s, %s)", (message.event_id,))]  # a parameter short
        return _statements(message)

    s = setup(statements=statements)
    records = [make_record(value={"n": n}, offset=n) for n in range(5)]
    result = s.processor.process(records)
    assert result.applied == 2 and result.dead_lettered == 3
    assert {letter.record.offset: letter.error_type for letter in s.letters.letters} == {
        1: "ValueError", 2: "TypeError", 3: "ProgrammingError"}
    assert "list of (query, params) pairs" in s.letters.letters[1].error
    assert s.effects() == {0: 1, 4: 1} and s.inbox_rows() == 2


def test_a_connection_lost_before_the_trip_leaves_the_message_unsettled(setup, sdk_db):
    s = setup()
    s.processor.process([make_record(value={"n": 0}, offset=0)])
    with psycopg.connect(sdk_db, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (s.store.conn.info.backend_pid,))
    record = make_record(value={"n": 1}, offset=1)
    with pytest.raises(DatabaseUnavailable):
        s.processor.process([record])
    assert record not in s.settled
    assert s.processor.process([record]).applied == 1  # a new connection; applied once
    assert s.effects() == {0: 1, 1: 1}


def test_without_pipeline_mode_the_statements_go_the_handlers_way(setup, monkeypatch):
    monkeypatch.setattr(psycopg.capabilities, "has_pipeline", lambda check=False: False)
    s = setup()
    # Warm: the first lookup, and psycopg's preparing of what it ran five times (a round trip).
    s.processor.process([make_record(value={"n": -i}, offset=i) for i in range(1, 7)])
    records = [make_record(value={"n": i}, offset=10 + i) for i in range(3)]
    with RoundTrips(s.store.conn) as trips:
        assert s.processor.process(records).applied == 3
    assert trips.count == 2 * 3 + 1  # a handler's cost: [COMMIT;] BEGIN; claim, the statement; the last COMMIT
    assert s.effects() == {**{-i: 1 for i in range(1, 7)}, 0: 1, 1: 1, 2: 1}


def test_an_opted_in_replay_is_keyed_apart_in_the_one_trip(setup):
    s = setup()
    event_id = uuid.uuid4()
    s.processor._store = ReplayingInbox(s.store, ["r1"])  # noqa: SLF001 - as InboxConsumer wraps it
    original = make_record(value={"n": 1}, event_id=event_id, offset=0)
    replayed = make_record(value={"n": 2}, event_id=event_id, offset=1, headers={"replay_id": "r1"})
    assert s.processor.process([original, replayed]).applied == 2
    keys = s.store.conn.execute("SELECT consumer FROM outbox_inbox WHERE event_id = %s ORDER BY 1",
                                (event_id,)).fetchall()
    assert keys == [(s.consumer,), (f"{s.consumer}/replay/r1",)]


def test_the_consumer_applies_every_event_once_through_redelivery_and_failures(sdk_db, broker, sdk_topic,
                                                                              run_consumer):
    """InboxConsumer(statements=...), one at a time, every event reaching Kafka twice; one event
    in ten fails its statement every time and is dead-lettered after its retries."""
    n = 120
    ids = write_numbered(sdk_db, sdk_topic, n)
    publish_all(sdk_db, broker.bootstrap, times=2)
    failing = {i for i in range(n) if i % 10 == 3}

    def statements(message: InboxMessage) -> list[tuple[Any, Any]]:
        i = message.json()["n"]
        writes: list[tuple[Any, Any]] = [
            ("INSERT INTO effects (event_id, consumer, n) VALUES (%s, %s, %s)", (message.event_id, "c", i))]
        if i in failing:
            writes.append(("SELECT 1 / (%s::int - %s::int)", (i, i)))
        return writes

    retry = RetryPolicy(max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.01)
    config = make_config(sdk_db, broker, sdk_topic, batch_size=1, retry=retry)
    thread = run_consumer(config, None, statements=statements)
    wait_settled(thread, 2 * n)
    thread.stop()
    effects = effect_counts(sdk_db)
    assert effects == {ids[i]: 1 for i in range(n) if i not in failing}
    letters = read_all(broker.bootstrap, f"{sdk_topic}.dlq", expected=2 * len(failing), timeout_s=30,
                       extra_wait_s=0.5)
    assert {json.loads(r.value)["n"] for r in letters} == failing
    assert {r.headers["dlq_reason"] for r in letters} == {b"retries_exhausted"}
    assert thread.consumer.totals.applied == n - len(failing)


def _strict_prepared(s: _Setup) -> int:
    row = s.store.conn.execute("SELECT count(*) FROM pg_prepared_statements WHERE name = %s",
                               (CLAIM_STRICT_STATEMENT.decode(),)).fetchone()
    assert row is not None
    return int(row[0])


def test_the_trip_claims_with_the_prepared_strict_claim(setup):
    s = setup()
    s.processor.process([make_record(value={"n": -1}, offset=0)])
    with RoundTrips(s.store.conn) as trips:
        assert s.processor.process([make_record(value={"n": i}, offset=1 + i) for i in range(3)]).applied == 3
    assert trips.count == 3
    assert not [sent for sent in trips.sent if "outbox_inbox" in sent], trips.sent  # no claim text sent
    assert _strict_prepared(s) == 1


def test_a_lost_prepared_strict_claim_sends_the_message_the_usual_way_then_is_prepared_again(setup):
    s = setup()
    s.processor.process([make_record(value={"n": -1}, offset=0)])
    s.store.conn.execute(f"DEALLOCATE {CLAIM_STRICT_STATEMENT.decode()}")  # as DISCARD ALL would
    batch = [make_record(value={"n": i}, offset=1 + i) for i in range(3)]
    result = s.processor.process(batch)
    assert (result.applied, result.settled) == (3, 3)
    assert s.effects() == {-1: 1, 0: 1, 1: 1, 2: 1}
    assert _strict_prepared(s) == 1
    # The three went out chained: the lost claim failed its trip and the two sent after it;
    # then the usual way for it, and a trip each for the two.
    assert s.calls[0] == 2 and s.calls[1] == s.calls[2] == 2
    assert s.store._prepared_losses == 0  # noqa: SLF001 - the next trip went through prepared


def test_losses_in_a_row_turn_the_prepared_strict_claim_off_not_the_trip(setup):
    s = setup()
    s.processor.process([make_record(value={"n": -1}, offset=0)])
    s.store._prepared_losses = 3  # noqa: SLF001 - a pooler that moves sessions between servers
    s.store.reset()  # a new connection: nothing prepared on it
    batch = [make_record(value={"n": i}, offset=1 + i) for i in range(3)]
    with RoundTrips(s.store.conn) as trips:
        assert s.processor.process(batch).applied == 3
    assert trips.count == 3  # still one trip a message, the claim bound as text
    assert len([sent for sent in trips.sent if "INSERT INTO outbox_inbox" in sent]) == 3
    assert _strict_prepared(s) == 0


def test_a_chain_through_the_prepared_strict_claim_ends_a_run_of_losses(setup):
    """Losses count in a row: one-trip transactions that commit through the prepared claim
    end the run, as claim_and_apply's do.  Chained ones did not, so scattered losses over a
    long life (a pooler that moves sessions now and then) added up to the limit, and the
    store bound the claim as text from then on."""
    s = setup()
    s.processor.process([make_record(value={"n": -1}, offset=0)])
    s.store._prepared_losses = 2  # noqa: SLF001 - two losses in a row already, one short of the limit
    with RoundTrips(s.store.conn) as trips:
        assert s.processor.process([make_record(value={"n": i}, offset=1 + i) for i in range(3)]).applied == 3
    assert not [sent for sent in trips.sent if "outbox_inbox" in sent], trips.sent  # prepared, chained
    assert s.store._prepared_losses == 0  # noqa: SLF001


def test_a_batch_sends_every_new_messages_statements_in_one_round_trip(setup):
    s = setup(batch_size=100)
    s.processor.process([make_record(value={"n": -i}, offset=i) for i in range(1, 4)])  # warm: the lookup
    records = [make_record(value={"n": i}, offset=i) for i in range(20, 60)]
    with RoundTrips(s.store.conn) as trips:
        assert s.processor.process(records).applied == 40
    assert trips.count == 4  # BEGIN with the claims, the savepoint, the 40 statements, COMMIT
    assert s.effects() == {**{-i: 1 for i in range(1, 4)}, **{i: 1 for i in range(20, 60)}}
    assert s.settled[-40:] == records
    redelivered = s.processor.process(records[:20] + [make_record(value={"n": 100}, offset=99)])
    assert (redelivered.duplicates, redelivered.applied) == (20, 1)
    assert s.effects()[25] == 1 and s.effects()[100] == 1


def test_a_failing_statement_in_a_batch_sends_it_one_message_at_a_time(setup):
    s = setup(batch_size=100, retry=RetryPolicy(max_attempts=2, backoff_initial_s=0.01))
    records = [make_record(value={"n": n}, offset=i) for i, n in enumerate(range(10, 20))]  # 13 fails
    result = s.processor.process(records)
    assert (result.applied, result.dead_lettered) == (9, 1)
    (letter,) = s.letters.letters
    assert letter.record is records[3] and letter.error_type == "CheckViolation"
    assert s.effects() == {n: 1 for n in range(10, 20) if n != 13}
    assert s.inbox_rows() == 9 and s.settled == records


def test_a_batch_whose_statements_handler_raises_goes_one_message_at_a_time(setup):
    def statements(message: InboxMessage) -> Any:
        if message.json()["n"] == 2:
            raise ValueError("no statement for two")
        return _statements(message)

    s = setup(statements=statements, batch_size=100)
    records = [make_record(value={"n": n}, offset=n) for n in range(5)]
    result = s.processor.process(records)
    assert (result.applied, result.dead_lettered) == (4, 1)
    assert s.letters.letters[0].error_type == "ValueError"
    assert s.effects() == {0: 1, 1: 1, 3: 1, 4: 1}


def test_without_pipeline_mode_a_batch_runs_the_statements_one_by_one(setup, monkeypatch):
    monkeypatch.setattr(psycopg.capabilities, "has_pipeline", lambda check=False: False)
    s = setup(batch_size=100)
    records = [make_record(value={"n": i}, offset=i) for i in range(10)]
    assert s.processor.process(records).applied == 10
    assert s.effects() == {i: 1 for i in range(10)}


def test_the_stores_binder_does_not_keep_a_dropped_connection_alive(setup):
    """The transformer that binds the statements holds its connection: the store drops it
    with the connection (a kept one leaked every connection once, see c98a812)."""
    import gc
    import weakref

    s = setup()
    s.processor.process([make_record(value={"n": 1}, offset=1)])
    old = weakref.ref(s.store.conn)
    s.store.reset()
    gc.collect()
    assert old() is None
    assert s.processor.process([make_record(value={"n": 2}, offset=2)]).applied == 1  # a new one binds
    assert s.effects() == {1: 1, 2: 1}


def test_a_duplicates_trip_keeps_the_prepared_claims(setup):
    """The failed trip is rolled back below psycopg: psycopg's own rollback() answers with
    DEALLOCATE ALL once it holds prepared statements of its own, which took the prepared
    strict claim along, and the next message went the usual way to prepare it again."""
    s = setup()
    for _ in range(6):  # psycopg prepares what it ran five times: it holds a statement now
        s.store.conn.execute("SELECT count(*) FROM ot_effects WHERE n = %s", (0,))
    records = [make_record(value={"n": i}, offset=i) for i in range(2)]
    s.processor.process(records[:1])
    assert s.processor.process(records[:1]).duplicates == 1  # the trip meets the inbox row
    with RoundTrips(s.store.conn) as trips:
        assert s.processor.process(records[1:]).applied == 1
    # The lookup before the poll (a duplicate was seen), then one trip: the prepared strict
    # claim was still there.
    assert trips.count == 2, trips.sent
    assert _strict_prepared(s) == 1 and s.calls[1] == 1


# -- chained: one at a time, the trips sent ahead of their answers ----------------------


def test_one_at_a_time_the_trips_are_sent_ahead_of_their_answers(setup):
    """Each message is its own transaction (its own Sync), and all five go to the server before
    the first answer is read: the server applies one while the client prepares the next."""
    s = setup()
    s.processor.process([make_record(value={"n": -1}, offset=0)])  # warm: the lookup, the prepared claim
    records = [make_record(value={"n": i}, offset=1 + i) for i in range(5)]
    with RoundTrips(s.store.conn) as trips:
        result = s.processor.process(records)
    assert (result.applied, result.duplicates) == (5, 0) and s.settled[-5:] == records
    first_answer = next(i for i, line in enumerate(trips.lines) if line.startswith("B\t") and "\tReadyForQuery" in line)
    assert sum(1 for line in trips.lines[:first_answer] if line.startswith("F\t") and "\tSync" in line) == 5
    assert trips.count == 5
    assert s.effects() == {n: 1 for n in range(-1, 5)} and s.inbox_rows() == 6
    assert s.store.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_commit_failing_in_a_chain_fails_every_transaction_sent_after_it(setup):
    """A deferred constraint fails the third message's COMMIT: its transaction ends, rolled back,
    and the next one's BEGIN would start afresh.  The chain statement fails the ones sent after
    it instead: they are applied after the failing one was dead-lettered, in order, each once
    (none of them found applied already: no duplicate)."""
    s = setup()
    s.processor.process([make_record(value={"n": 2}, offset=0)])
    records = [make_record(value={"n": n}, offset=1 + i) for i, n in enumerate([0, 1, 2, 3, 4, 5])]
    with pytest.raises(FatalError, match="ot_deferred"):  # the usual way meets the COMMIT error: a stop
        s.processor.process(records)
    assert s.settled[1:] == records[:2]
    assert s.effects() == {0: 1, 1: 1, 2: 1}  # nothing of 3, 4 and 5 committed ahead of the failure
    assert s.calls[3] == s.calls[4] == s.calls[5] == 1  # each sent once, failed by the chain
    s.store.conn.execute("DELETE FROM ot_effects WHERE n = 2")  # the operator's fix
    result = s.processor.process(records[2:])
    assert (result.applied, result.duplicates) == (4, 0)
    assert s.effects() == {n: 1 for n in range(6)}
    assert s.settled[3:] == records[2:]


def test_a_duplicate_in_a_chain_is_dropped_and_the_rest_applied_once_in_order(setup):
    s = setup()
    applied = make_record(value={"n": 3}, offset=3)
    s.processor.process([applied])
    records = [make_record(value={"n": n}, offset=n) for n in range(3)] + [applied] + [
        make_record(value={"n": n}, offset=n) for n in range(4, 8)]
    result = s.processor.process(records)
    assert (result.applied, result.duplicates) == (7, 1)
    assert s.settled[1:] == records
    assert s.effects() == {n: 1 for n in range(8)}
    assert s.store.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_connection_killed_in_the_middle_of_a_chain_loses_nothing_and_applies_nothing_twice(setup, sdk_db):
    """The sixth message's statement waits; the connection is terminated meanwhile.  The chain
    ends with DatabaseUnavailable; what was settled had committed; processing the unsettled
    records again applies each remaining event once (those that committed are duplicates)."""
    def statements(message: InboxMessage) -> list[tuple[Any, Any]]:
        pause = [("SELECT pg_sleep(0.5)", None)] if message.json()["n"] == 5 else []
        return pause + _statements(message)

    s = setup(statements=statements)
    s.processor.process([make_record(value={"n": -1}, offset=0)])
    records = [make_record(value={"n": n}, offset=1 + n) for n in range(12)]
    pid = s.store.conn.info.backend_pid

    def kill() -> None:
        with psycopg.connect(sdk_db, autocommit=True) as admin:
            for _ in range(100):  # until the pause runs
                row = admin.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
                if row is not None and "pg_sleep" in str(row[0]):
                    break
                threading.Event().wait(0.02)
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    killer = threading.Thread(target=kill)
    killer.start()
    with pytest.raises(DatabaseUnavailable):
        s.processor.process(records)
    killer.join()
    settled = s.settled[1:]
    assert settled == records[:len(settled)] and len(settled) <= 5
    rest = records[len(settled):]
    result = s.processor.process(rest)
    assert result.applied + result.duplicates == len(rest) and result.applied >= 12 - 5
    assert s.effects() == {n: 1 for n in range(-1, 12)}
    assert s.settled[1:] == records


def test_a_lost_prepared_lookup_of_the_stores_own_is_retried_not_fatal(setup):
    """A redelivered message that the claim (not the lookup before the poll) finds: its trip
    fails, then the usual way looks its inbox row up with the store's own statement, which
    psycopg prepares after five runs.  A transaction pooler that moves the session to a
    server without it (here: that statement deallocated below psycopg) made that a FatalError, which
    stops the consumer.  Now it is retried as for a database that went away, with psycopg's
    automatic preparing off."""
    s = setup()
    record = make_record(value={"n": 1}, offset=0)
    s.processor.process([record])
    for _ in range(7):  # redeliveries, each claimed: the lookup runs (and is prepared by psycopg)
        s.processor._lookup_pays = False  # noqa: SLF001 - as after a poll of new messages
        assert s.processor.process([record]).duplicates == 1
    found = s.store.conn.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE '\\_pg3\\_%%' "
                                 "AND statement LIKE '%%FROM outbox_inbox%%'").fetchone()
    assert found is not None, "psycopg prepared the lookup"
    # Another server session, which holds the store's named claims but not psycopg's statement
    # (dropped below psycopg, which does not know).
    s.store.conn.pgconn.exec_(b"DEALLOCATE " + found[0].encode())
    s.processor._lookup_pays = False  # noqa: SLF001
    with pytest.raises(DatabaseUnavailable, match="automatic preparing is off"):
        s.processor.process([record])
    assert s.processor.process([record]).duplicates == 1  # the loop's retry, on a new connection
    assert s.store.conn.prepare_threshold is None
    assert s.effects() == {1: 1}
