"""The loop's statements the server cancelled, counted by statement (relay/app_run.py
``_cancelled_statement``, relay/app_deps.py ``_statement_cancelled``,
``outbox_relay_statements_cancelled_total``).  Pure logic: the stores are fakes; the real
database's case is tests/integration/test_cancelled_claims_backlog.py."""

from __future__ import annotations

from typing import Any

import pytest

from relay.errors import StatementCancelled
from relay.metrics import CANCELLED_STATEMENTS, RelayMetrics
from relay.model import START
from relay.pump import Pump
from tests.unit.pump_fakes import Leases, Log, Publisher, Store, row
from tests.unit.test_heartbeat_late import Log as Events
from tests.unit.test_mark_connection_lost_decision import _relay

CANCELLED = StatementCancelled("statement cancelled: canceling statement due to statement timeout")
NAME = "outbox_relay_statements_cancelled_total"


class CancelledClaims(Store):
    """A store whose claims the server cancels while ``cancelling``."""

    cancelling = False

    def claim(self, **kwargs: Any) -> Any:
        if self.cancelling:
            raise CANCELLED
        return super().claim(**kwargs)


def test_each_statements_series_is_shown_at_zero_from_the_start() -> None:
    """So that increase() sees the first cancel of each (as f619ae8 did for mark losses)."""
    registry = RelayMetrics().registry
    assert {statement: registry.get_sample_value(NAME, {"statement": statement})
            for statement in CANCELLED_STATEMENTS} == dict.fromkeys(("claim", "sweep", "heartbeat", "other"), 0.0)


def test_a_cancelled_claim_is_counted_as_one_and_leaves_the_cursor_as_it_was() -> None:
    store = CancelledClaims([row(1, 0), row(2, 0), row(3, 0)])
    publisher = Publisher()
    pump = Pump(store=store, publisher=publisher, leases=Leases(), nshards=1, batch_size=1,  # type: ignore[arg-type]
                pipeline_depth=1, max_attempts=3, backoff_initial_s=0.1, backoff_max_s=1.0,
                metrics=RelayMetrics(), log=Log())
    pump.run_once()  # claims row 1
    cursor = pump.cursor
    assert cursor != START and pump.statement == "other"
    store.cancelling = True
    with pytest.raises(StatementCancelled):
        pump.run_once()  # settles row 1, then its claim is cancelled
    assert pump.statement == "claim" and pump.cursor == cursor and publisher.sent == [1]
    log = Events()
    relay, _claims, _mark = _relay(log)
    relay._statement, relay.pump = "turn", pump
    assert relay._statement_cancelled(CANCELLED, relay._cancelled_statement()) and relay._cancelled_wait_s() > 0
    relay._statement = "heartbeat"
    assert relay._statement_cancelled(CANCELLED, relay._cancelled_statement()) and relay._cancelled_wait_s() > 0
    registry = relay.metrics.registry
    assert [registry.get_sample_value(NAME, {"statement": statement}) for statement in CANCELLED_STATEMENTS] == [
        1.0, 0.0, 1.0, 0.0]
    said = [fields for event, fields in log.events if event == "statement_cancelled"]
    assert len(said) == 1 and said[0]["statement"] == "claim", log.events  # once a streak: the first one's
    store.cancelling = False
    pump.request_rewind()
    for _ in range(6):
        pump.run_once()
    assert publisher.sent == [1, 2, 3] and not store.pending



class CancelledSweeps(Store):
    """A store whose rewinds' sweeps the server cancels."""

    def sweep(self, **_: Any) -> tuple[int, float | None]:
        raise CANCELLED


def test_a_cancelled_sweep_is_named_so_and_leaves_the_cursor_at_the_start() -> None:
    pump = Pump(store=CancelledSweeps([row(1, 0)]), publisher=Publisher(), leases=Leases(), nshards=1,  # type: ignore[arg-type]
                batch_size=1, pipeline_depth=1, max_attempts=3, backoff_initial_s=0.1, backoff_max_s=1.0,
                metrics=RelayMetrics(), log=Log())
    with pytest.raises(StatementCancelled):
        pump.run_once()  # the first claim's rewind
    assert pump.statement == "sweep" and pump.cursor == START
