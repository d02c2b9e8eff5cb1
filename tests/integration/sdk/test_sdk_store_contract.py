"""One contract, two stores: the in-memory fake shipped in consumer_sdk.testing must behave
like the PostgreSQL inbox, so tests written against the fake stay true."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from consumer_sdk.model import InboxMessage, payload_sha256
from consumer_sdk.store import PgInboxStore, connect_factory
from consumer_sdk.testing import FakeInboxStore


@pytest.fixture(params=["fake", "postgresql"])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "fake":
        yield FakeInboxStore()
        return
    dsn = request.getfixturevalue("sdk_db")
    pg = PgInboxStore(connect_factory(dsn))
    yield pg
    pg.close()


def _message(event_id: uuid.UUID, value: bytes | None = b'{"n": 1}') -> InboxMessage:
    return InboxMessage(event_id=event_id, topic="t", partition=0, offset=0, key=None, value=value, headers={})


def _claim(store: Any, message: InboxMessage, consumer: str = "c") -> str:
    with store.transaction(), store.attempt():
        return str(store.claim(consumer=consumer, message=message, payload_sha256=payload_sha256(message.value)))


def test_new_then_duplicate_then_mismatch(store):
    event_id = uuid.uuid4()
    assert _claim(store, _message(event_id)) == "new"
    assert _claim(store, _message(event_id)) == "duplicate"
    assert _claim(store, _message(event_id, b'{"n": 2}')) == "mismatch"
    assert _claim(store, _message(event_id), consumer="other") == "new"


def test_tombstones_compare_equal_to_each_other_only(store):
    event_id = uuid.uuid4()
    assert _claim(store, _message(event_id, None)) == "new"
    assert _claim(store, _message(event_id, None)) == "duplicate"
    assert _claim(store, _message(event_id, b"")) == "mismatch"


def test_a_rolled_back_savepoint_or_transaction_forgets_the_claim(store):
    event_id = uuid.uuid4()
    with store.transaction():
        with pytest.raises(RuntimeError), store.attempt():
            store.claim(consumer="c", message=_message(event_id), payload_sha256=None)
            raise RuntimeError("handler failed")
        with store.attempt():  # the same transaction goes on
            assert store.claim(consumer="c", message=_message(uuid.uuid4()), payload_sha256=None) == "new"
    with pytest.raises(RuntimeError), store.transaction():
        with store.attempt():
            store.claim(consumer="c", message=_message(event_id), payload_sha256=None)
        raise RuntimeError("commit never happens")
    assert _claim(store, _message(event_id)) == "new"


def test_the_pg_store_keeps_where_and_when(sdk_db):
    store = PgInboxStore(connect_factory(sdk_db))
    message = InboxMessage(event_id=uuid.uuid4(), topic="orders", partition=2, offset=41, key=b"k",
                           value=b"{}", headers={})
    with store.transaction(), store.attempt():
        store.claim(consumer="c", message=message, payload_sha256=payload_sha256(message.value))
    store.close()
    with psycopg.connect(sdk_db) as conn:
        row = conn.execute("SELECT topic, kafka_partition, kafka_offset, payload_sha256, "
                           "received_at > now() - interval '1 minute' FROM outbox_inbox").fetchone()
    assert row == ("orders", 2, 41, payload_sha256(b"{}"), True)


@pytest.mark.parametrize(("first_commits", "second_sees"), [(True, "duplicate"), (False, "new")])
def test_two_members_claiming_one_event_at_once_apply_it_once(sdk_db, first_commits, second_sees):
    """A member that lost its partition without knowing races the new owner: the second
    claim waits for the first transaction and then sees its outcome."""
    import threading

    event_id = uuid.uuid4()
    first, second = PgInboxStore(connect_factory(sdk_db)), PgInboxStore(connect_factory(sdk_db))
    claimed = threading.Event()
    outcome: list[str] = []

    def race() -> None:
        claimed.wait(10)
        outcome.append(_claim(second, _message(event_id)))

    racer = threading.Thread(target=race)
    racer.start()
    try:
        with first.transaction():
            with first.attempt():
                assert first.claim(consumer="c", message=_message(event_id),
                                   payload_sha256=payload_sha256(b'{"n": 1}')) == "new"
            claimed.set()
            with psycopg.connect(sdk_db, autocommit=True) as watcher:  # the racer is blocked on our row
                wait_for_lock_wait(watcher)
            if not first_commits:
                raise _Rollback()
    except _Rollback:
        pass
    racer.join(10)
    first.close()
    second.close()
    assert outcome == [second_sees]


class _Rollback(Exception):
    pass


def wait_for_lock_wait(conn: psycopg.Connection) -> None:
    from tests.fixtures.procs import wait_until

    wait_until(lambda: conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'").fetchone() == (1,), timeout_s=10, message="the racer never blocked")


def _claim_many(store: Any, messages: list[InboxMessage], consumer: str = "c") -> list[str]:
    with store.transaction():
        return [str(c) for c in store.claim_many(consumer=consumer, messages=messages,
                                                 digests=[payload_sha256(m.value) for m in messages])]


def test_claim_many_says_what_each_event_was_in_order(store):
    old, reused, tomb = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert _claim_many(store, [_message(old), _message(reused), _message(tomb, None)]) == ["new"] * 3
    fresh = uuid.uuid4()
    batch = [_message(fresh), _message(old), _message(reused, b'{"n": 2}'), _message(tomb, None)]
    assert _claim_many(store, batch) == ["new", "duplicate", "mismatch", "duplicate"]
    assert _claim_many(store, [_message(old)], consumer="other") == ["new"]
    assert _claim(store, _message(fresh)) == "duplicate"  # committed with the batch
    assert _claim_many(store, []) == []


@pytest.mark.parametrize(("first_commits", "second_sees"), [(True, ["duplicate", "new"]), (False, ["new", "new"])])
def test_claim_many_racing_a_member_that_commits_meanwhile(sdk_db, first_commits, second_sees):
    """The batch statement's snapshot predates the rival's commit: the row it waited for is
    'unseen' there, and a second statement tells a duplicate from a mismatch."""
    import threading

    event_id, other = uuid.uuid4(), uuid.uuid4()
    first, second = PgInboxStore(connect_factory(sdk_db)), PgInboxStore(connect_factory(sdk_db))
    claimed = threading.Event()
    outcome: list[list[str]] = []

    def race() -> None:
        claimed.wait(10)
        outcome.append(_claim_many(second, [_message(event_id), _message(other)]))

    racer = threading.Thread(target=race)
    racer.start()
    try:
        with first.transaction():
            assert first.claim_many(consumer="c", messages=[_message(event_id)],
                                    digests=[payload_sha256(b'{"n": 1}')]) == ["new"]
            claimed.set()
            with psycopg.connect(sdk_db, autocommit=True) as watcher:
                wait_for_lock_wait(watcher)
            if not first_commits:
                raise _Rollback()
    except _Rollback:
        pass
    racer.join(10)
    first.close()
    second.close()
    assert outcome == [second_sees]
