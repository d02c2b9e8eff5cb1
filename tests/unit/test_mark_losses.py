"""A mark connection lost again and again (relay/marker.py MarkLosses): from its second loss
in a row, its re-open waits a back-off (relay/wakeup.py ReopenBackOff) and the other mark
connections take its work (relay/mark_lanes.py); a streak is said once, every loss counted
(relay/app_deps.py).  Pure logic: the stores are faked, the clock too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import generate_latest

from relay.app import Relay
from relay.config import build_settings
from relay.mark_lanes import MarkLanes
from relay.marker import LOSS_STREAK_S, Marker, MarkLosses
from relay.model import OutboxRow, ShardId, Token
from relay.wakeup import REOPEN_BACKOFF_S
from tests.unit.test_heartbeat_late import Log
from tests.unit.test_mark_connection_lost_decision import _lost, _relay
from tests.unit.test_marker import row


def test_the_second_loss_in_a_row_holds_the_re_open_back_and_a_quiet_spell_ends_the_streak() -> None:
    now = [100.0]
    losses = MarkLosses(lambda: now[0])
    assert losses.lost() and not losses.holding()  # the first: re-opened at once, as before
    now[0] += 5.0
    assert not losses.lost() and losses.holding() and losses.in_a_row == 2  # again: not said, held
    now[0] += 2 * REOPEN_BACKOFF_S - 0.01
    assert losses.holding()
    now[0] += 0.02
    assert not losses.holding()
    now[0] += LOSS_STREAK_S + 1.0
    assert losses.lost() and losses.in_a_row == 1 and not losses.holding()  # a new streak


class Recording:
    """A mark store that marks every row and records which it got, and when (``clock``)."""

    def __init__(self, clock: Callable[[], float] = lambda: 0.0) -> None:
        self.rows: list[int] = []
        self.marked_at: list[float] = []
        self.clock = clock
        self.losses = MarkLosses(clock)

    def mark_published(self, *, owner: str, leases: Any, rows: list[OutboxRow]) -> Any:
        self.rows.extend(row.id for row in rows)
        self.marked_at.append(self.clock())
        return {lease.shard for lease in leases}, {row.id for row in rows}


def _rows(count: int) -> list[OutboxRow]:
    return [row(i, shard=i % 8) for i in range(1, count + 1)]


def test_a_mark_thread_whose_connection_is_held_back_marks_once_the_back_off_is_over() -> None:
    ticks = [0.0]

    def clock() -> float:  # each look moves time on by 0.25 s
        ticks[0] += 0.25
        return ticks[0]

    store = Recording(clock)
    store.losses.lost()
    store.losses.lost()  # the second in a row: its re-open waits 2 s
    due = ticks[0] + 2 * REOPEN_BACKOFF_S
    marker = Marker(store, "me")  # type: ignore[arg-type]
    marker.start()
    try:
        marker.submit({ShardId(0): Token(1)}, [row(1)]).result(timeout=10)
    finally:
        marker.stop()
    assert store.rows == [1] and store.marked_at[0] >= due, (store.marked_at, due)


def test_a_connection_held_back_gets_no_work_while_another_marks() -> None:
    now = [0.0]
    first, second = Recording(), Recording(lambda: now[0])
    second.losses.lost()
    second.losses.lost()  # lost twice in a row: held back for 2 s
    lanes = MarkLanes([first, second], "me", split_rows=10)  # type: ignore[list-item]
    lanes.start()
    try:
        rows = _rows(100)
        tokens = {ShardId(s): Token(1) for s in range(8)}
        assert lanes.submit(tokens, rows).result(timeout=10)[1] == {row.id for row in rows}
        assert len(first.rows) == 100 and second.rows == []
        now[0] += 10.0  # the back-off is over: split again
        assert len(lanes.submit(tokens, _rows(100)).result(timeout=10)[1]) == 100
        assert second.rows
    finally:
        lanes.stop()


def test_a_loss_in_a_row_is_counted_not_said_again() -> None:
    log = Log()
    relay, _claims, mark = _relay(log)
    now = [0.0]
    mark.losses = MarkLosses(lambda: now[0])  # type: ignore[attr-defined]
    for _ in range(3):
        assert relay._mark_connection_lost(_lost(mark))
        now[0] += 1.0
    assert [event for event, _ in log.events] == ["mark_connection_lost"]
    counted = relay.metrics.registry.get_sample_value("outbox_relay_mark_connection_losses_total",
                                                     {"connection": "outbox-relay:me:mark"})
    assert counted == 3 and mark.losses.holding()  # type: ignore[attr-defined]
    now[0] += LOSS_STREAK_S + 1.0
    assert relay._mark_connection_lost(_lost(mark)) and len(log.events) == 2  # a new streak: said


def test_each_mark_connections_loss_series_is_shown_at_zero_from_the_start() -> None:
    """Before, a connection's series appeared at its first loss, and increase() over the
    window of that loss missed it (no sample before it to rise from)."""
    settings = build_settings({"dsn": "postgresql://u@127.0.0.1/db", "bootstrap_servers": "127.0.0.1:9092",
                               "owner": "me", "mark_connections": "2"})
    relay = Relay(settings, log=Log())
    shown = generate_latest(relay.metrics.registry).decode()
    for name in ("outbox-relay:me:mark", "outbox-relay:me:mark2"):
        assert f'outbox_relay_mark_connection_losses_total{{connection="{name}"}} 0.0' in shown, shown
