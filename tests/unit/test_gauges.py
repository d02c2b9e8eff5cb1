"""relay/gauges.py: the backlog gauges' refresh, paced by its own cost."""

from __future__ import annotations

from typing import Any

import pytest

from relay.errors import DatabaseUnavailable
from relay.gauges import COST_RATIO, BacklogGauges


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))


class Store:
    """Each count takes ``took_s`` of the clock; answers the next of ``answers``."""

    def __init__(self, clock: list[float], answers: list[Any], took_s: float) -> None:
        self.clock, self.answers, self.took_s = clock, answers, took_s
        self.counts = 0

    def backlog(self) -> tuple[int, float, int]:
        self.counts += 1
        self.clock[0] += self.took_s
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def gauges(answers: list[Any], took_s: float) -> tuple[BacklogGauges, Store, list[Any], Log, list[float]]:
    clock = [100.0]
    store = Store(clock, answers, took_s)
    published: list[Any] = []
    log = Log()
    g = BacklogGauges(store, interval_s=5.0, publish=lambda *fig: published.append(fig), log=log,
                      clock=lambda: clock[0])
    return g, store, published, log, clock


def test_a_cheap_count_runs_every_interval_and_publishes_its_figures() -> None:
    g, store, published, log, clock = gauges([(7, 12.5, 1), (3, 2.0, 0)], took_s=0.01)
    g.run_once(clock[0])  # the first turn counts
    assert published == [(7, 12.5, 1)] and g.next_at == pytest.approx(105.01)
    clock[0] = 104.0
    g.run_once(clock[0])  # not due
    assert store.counts == 1
    clock[0] = 105.5
    g.run_once(clock[0])
    assert published[-1] == (3, 2.0, 0) and log.events == []


def test_a_costly_count_puts_the_next_one_further_away_and_says_so() -> None:
    # 300,000 rows held pending counted in 0.6 s: the next count 12 s later, not 5.
    g, store, _, log, clock = gauges([(300_000, 60.0, 300_000)] * 2, took_s=0.6)
    g.run_once(clock[0])
    assert g.next_at == pytest.approx(100.6 + COST_RATIO * 0.6)
    assert log.events == [("backlog_slow", {"seconds": 0.6, "next_refresh_in_s": COST_RATIO * 0.6})]
    clock[0] = 100.6 + 5.0
    g.run_once(clock[0])  # the interval has passed, the spacing has not
    assert store.counts == 1
    # However large, counting takes at most 1 / COST_RATIO of the loop's time.
    assert 0.6 / (g.next_at - 100.0) <= 1 / COST_RATIO + 1e-9


def test_a_failed_count_propagates_and_is_tried_again_at_the_next_turn() -> None:
    g, store, published, _, clock = gauges([DatabaseUnavailable("gone"), (1, 0.0, 0)], took_s=0.0)
    with pytest.raises(DatabaseUnavailable):
        g.run_once(clock[0])
    g.run_once(clock[0])
    assert published == [(1, 0.0, 0)] and store.counts == 2


def test_a_count_the_server_cancelled_is_skipped_and_publishing_goes_on() -> None:
    # A statement_timeout on the relay's role shorter than the count of a large backlog: the
    # count failed as "database unavailable", was retried first at every turn, and the relay
    # never claimed again, its gauges at 0 (an audit of the relay's operation).
    from relay.errors import StatementCancelled
    from relay.gauges import CANCELLED_WAIT_S

    g, store, published, log, clock = gauges([StatementCancelled("statement timeout"), (5, 1.0, 0)], took_s=0.1)
    g.run_once(clock[0])  # no exception: the loop goes on claiming
    assert published == [] and [e for e, _ in log.events] == ["backlog_count_cancelled"]
    assert g.next_at == pytest.approx(100.1 + CANCELLED_WAIT_S)
    clock[0] = g.next_at
    g.run_once(clock[0])
    assert published == [(5, 1.0, 0)]


def test_the_store_tells_a_cancelled_statement_from_a_lost_connection() -> None:
    import psycopg.errors

    from relay.errors import StatementCancelled
    from relay.store import translated

    with pytest.raises(StatementCancelled, match="statement cancelled"), translated():
        raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
    with pytest.raises(DatabaseUnavailable) as lost, translated():
        raise psycopg.OperationalError("server closed the connection unexpectedly")
    assert not isinstance(lost.value, StatementCancelled)
