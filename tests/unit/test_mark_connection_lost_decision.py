"""Which line a broken mark connection gets (relay/marker.py MarkConnectionLost,
relay/app_deps.py Dependencies._mark_connection_lost): its own loss while the claims
connection answers (``mark_connection_lost``, once a failed statement), the outage's
otherwise.  Pure logic, the stores faked; the real database's case is
tests/integration/test_mark_connection_lost.py."""

from __future__ import annotations

from typing import Any

import pytest

from relay.app import Relay
from relay.config import build_settings
from relay.errors import DatabaseReadOnly, DatabaseUnavailable, StatementCancelled
from relay.marker import MarkCancelled, MarkConnectionLost, MarkLosses, mark_rows
from tests.unit.test_heartbeat_late import Log


class Failing:
    """A mark store whose statements raise ``error``; its ping raises ``ping_error``."""

    def __init__(self, error: Exception | None = None, name: str = "outbox-relay:me:mark") -> None:
        self.error = error
        self.name = name
        self.marks = 0  # committed (relay.store.Store.marks)
        self.losses = MarkLosses()
        self.ping_error: Exception | None = None
        self.pings = 0

    def mark_published(self, **_kwargs: Any) -> Any:
        assert self.error is not None
        raise self.error

    def reset(self) -> None: ...

    def ping(self) -> None:
        self.pings += 1
        if self.ping_error is not None:
            raise self.ping_error


def _lost(store: Failing, text: str = "database connection lost: terminating connection") -> MarkConnectionLost:
    store.error = DatabaseUnavailable(text)
    with pytest.raises(MarkConnectionLost) as raised:
        mark_rows(store, "me", {}, [])  # type: ignore[arg-type]
    return raised.value


def test_a_mark_on_a_broken_connection_raises_its_loss_a_cancelled_one_its_cancel_a_read_only_one_as_is() -> None:
    store = Failing()
    lost = _lost(store)
    assert lost.store is store and isinstance(lost, DatabaseUnavailable)
    assert str(lost) == "database connection lost: terminating connection"
    store.error = DatabaseReadOnly("read-only")
    with pytest.raises(DatabaseReadOnly) as read_only:
        mark_rows(store, "me", {}, [])  # type: ignore[arg-type]
    assert read_only.value is store.error
    store.error = StatementCancelled("statement cancelled: canceling statement due to statement timeout")
    with pytest.raises(MarkCancelled) as cancelled:
        mark_rows(store, "me", {}, [])  # type: ignore[arg-type]
    assert cancelled.value.store is store and cancelled.value.rows == 0 and cancelled.value.__cause__ is store.error


def test_a_cancelled_mark_is_said_once_as_a_slow_statement_and_the_database_stays_up() -> None:
    log = Log()
    relay, claims, mark = _relay(log)
    mark.error = StatementCancelled("statement cancelled: canceling statement due to statement timeout")
    with pytest.raises(MarkCancelled) as raised:
        mark_rows(mark, "me", {}, [])  # type: ignore[arg-type]
    assert relay._mark_failed_alone(raised.value) and relay._mark_failed_alone(raised.value)
    assert relay.db_up and claims.pings == 0
    ((event, fields),) = log.events
    assert event == "mark_statement_cancelled" and fields["connection"] == "outbox-relay:me:mark", fields
    assert "raise the relay role's statement_timeout" in str(fields["detail"]).lower(), fields


def _relay(log: Log) -> tuple[Relay, Failing, Failing]:
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1/db", "bootstrap_servers": "127.0.0.1:9092",
                               "owner": "me"})
    relay = Relay(settings, log=log)
    claims, mark = Failing(), Failing()
    relay.store, relay.mark_stores = claims, [mark]  # type: ignore[assignment, list-item]
    relay.db_up = True
    return relay, claims, mark


def test_a_mark_connection_lost_while_the_claims_connection_answers_is_said_as_its_own_once() -> None:
    log = Log()
    relay, claims, mark = _relay(log)
    lost = _lost(mark, "database connection lost: postgresql://u:s3cr3t@db/x ended")
    assert relay._mark_connection_lost(lost) and relay._mark_connection_lost(lost)  # two batches, one statement
    assert claims.pings == 2 and relay.db_up
    ((event, fields),) = log.events
    assert event == "mark_connection_lost" and fields["connection"] == "outbox-relay:me:mark", fields
    assert "s3cr3t" not in str(fields) and "re-claimed (a rewind)" in str(fields["detail"]), fields
    assert relay._mark_connection_lost(_lost(mark)) and len(log.events) == 1  # again: a streak, said once


def test_it_is_the_outage_when_the_claims_connection_fails_too_or_the_database_was_down() -> None:
    log = Log()
    relay, claims, mark = _relay(log)
    claims.ping_error = DatabaseUnavailable("database connection lost")
    assert not relay._mark_connection_lost(_lost(mark))  # every backend ended, the server stopped
    claims.ping_error = None
    relay.db_up = False
    assert not relay._mark_connection_lost(_lost(mark)) and claims.pings == 1  # down already: no look
    relay.db_up = True
    assert not relay._mark_connection_lost(_lost(Failing()))  # marked on no mark connection of its own
    assert not relay._mark_connection_lost(DatabaseUnavailable("database connection lost"))  # not a mark's
    assert log.events == []


def test_a_mark_connection_found_broken_after_an_outage_is_the_outages() -> None:
    log = Log()
    relay, _claims, mark = _relay(log)
    relay._db_down(DatabaseUnavailable("database connection lost"))
    relay._db_ok()  # back, and no mark committed since
    assert relay._mark_connection_lost(_lost(mark))
    stale = [fields for event, fields in log.events if event.startswith("mark_connection")]
    assert [event for event, _ in log.events] == ["database_unavailable", "mark_connection_stale"]
    assert stale[0]["connection"] == "outbox-relay:me:mark" and "outage" in str(stale[0]["detail"]), stale


def test_the_lost_connection_is_named_by_its_store() -> None:
    """Its application_name is the store's, not one rebuilt from the owner and the lane (which
    named another connection when the two disagreed)."""
    log = Log()
    relay, _claims, _mark = _relay(log)
    second = Failing(name="outbox-relay:me:mark-pooled")
    relay.mark_stores.append(second)  # type: ignore[arg-type]
    assert relay._mark_connection_lost(_lost(second))
    ((_event, fields),) = log.events
    assert fields["connection"] == "outbox-relay:me:mark-pooled", fields


def test_after_an_outage_each_mark_connection_is_stale_until_a_mark_of_its_own_committed() -> None:
    """Per connection: the first mark of one does not make another's loss in the same outage
    its own (a warning that has an SRE look for a pooler ending connections)."""
    log = Log()
    relay, _claims, first = _relay(log)
    second = Failing(name="outbox-relay:me:mark2")
    relay.mark_stores.append(second)  # type: ignore[arg-type]
    relay._db_down(DatabaseUnavailable("database connection lost"))
    relay._db_ok()
    first.marks += 1  # the first connection re-opened and marked: it is proven, the second is not
    for store in (first, second, second):  # the second broken in the outage, then broken again
        assert relay._mark_connection_lost(_lost(store))
    said = [(event, fields["connection"]) for event, fields in log.events if event.startswith("mark_connection")]
    assert said == [("mark_connection_lost", "outbox-relay:me:mark"), ("mark_connection_stale", "outbox-relay:me:mark2"),
                    ("mark_connection_lost", "outbox-relay:me:mark2")], said


def test_a_claim_the_server_cancelled_is_said_once_a_streak_and_keeps_the_database_up() -> None:
    log = Log()
    relay, claims, mark = _relay(log)
    cancelled = StatementCancelled("statement cancelled: canceling statement due to statement timeout")
    assert relay._statement_cancelled(cancelled) and relay._cancelled_wait_s() > 0
    assert relay._statement_cancelled(cancelled) and relay._cancelled_wait_s() > 0  # again: not said
    assert relay.db_up and claims.pings == 0
    relay._statement_passed()
    relay._statement_passed()  # no streak: nothing said
    assert [event for event, _ in log.events] == ["statement_cancelled", "statement_recovered"], log.events
    assert log.events[0][1]["connection"] == claims.name and log.events[1][1]["cancelled"] == 2
    assert "statement_timeout" in str(log.events[0][1]["detail"]), log.events
    mark.error = cancelled
    with pytest.raises(MarkCancelled) as a_marks:
        mark_rows(mark, "me", {}, [])  # type: ignore[arg-type]
    assert not relay._statement_cancelled(a_marks.value)  # a mark's: relay/mark_cancels.py
    assert not relay._statement_cancelled(DatabaseUnavailable("database connection lost"))
    relay.db_up = False
    assert not relay._statement_cancelled(cancelled)  # the database down already: the outage's
