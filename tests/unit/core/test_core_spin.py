"""outbox_core.spin: when a wait polls before sleeping, and how psycopg's generators are
driven meanwhile (the connection itself is tested on a real PostgreSQL in
tests/integration/test_spin.py)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
from psycopg._enums import Ready, Wait

from outbox_core.spin import MISSES_BEFORE_PAUSE, SKIP_MAX, SKIP_MIN, Spinner, spinning


class FakeClock:
    def __init__(self, step_s: float) -> None:
        self.now = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def test_a_poll_returns_as_soon_as_the_answer_is_there() -> None:
    spinner = Spinner(100e-6, clock=FakeClock(10e-6))
    checks = iter([False, False, True])
    assert spinner.poll(lambda: next(checks)) is True


def test_a_poll_gives_up_once_the_budget_is_spent() -> None:
    clock = FakeClock(10e-6)
    spinner = Spinner(100e-6, clock=clock)
    calls = []
    assert spinner.poll(lambda: calls.append(1) is not None) is False  # never ready
    assert clock.now == pytest.approx(110e-6, abs=1e-9)  # the deadline, and the check that passed it
    assert len(calls) == 10


def test_misses_in_a_row_pause_the_polling_for_longer_each_time() -> None:
    spinner = Spinner(100e-6)
    for _ in range(MISSES_BEFORE_PAUSE - 1):
        assert spinner.wants()
        spinner.record(False)
    assert spinner.wants()  # three misses: still polling
    spinner.record(False)
    assert [spinner.wants() for _ in range(SKIP_MIN)] == [False] * SKIP_MIN
    assert spinner.skipped == SKIP_MIN
    assert spinner.wants()  # the try after the pause
    spinner.record(False)  # missed too: a pause twice as long
    assert [spinner.wants() for _ in range(2 * SKIP_MIN)] == [False] * (2 * SKIP_MIN)
    assert spinner.wants()


def test_the_pause_stops_doubling_at_its_cap() -> None:
    spinner = Spinner(100e-6)
    pauses = []
    for _ in range(12):
        skipped_before = spinner.skipped
        while not spinner.wants():
            pass
        pauses.append(spinner.skipped - skipped_before)
        spinner.record(False)
    assert pauses[:MISSES_BEFORE_PAUSE] == [0] * MISSES_BEFORE_PAUSE
    assert pauses[MISSES_BEFORE_PAUSE:] == [16, 32, 64, 128, 256, 512, 1024, 1024]
    assert max(pauses) == SKIP_MAX


def test_a_hit_ends_the_run_of_misses_and_the_pause_starts_small_again() -> None:
    spinner = Spinner(100e-6)
    for _ in range(MISSES_BEFORE_PAUSE):
        spinner.record(False)
    while not spinner.wants():
        pass
    spinner.record(False)  # second pause: 32
    while not spinner.wants():
        pass
    spinner.record(True)
    assert (spinner.hits, spinner.misses) == (1, MISSES_BEFORE_PAUSE + 1)
    for _ in range(MISSES_BEFORE_PAUSE - 1):
        spinner.record(False)
    assert spinner.wants()  # three misses after a hit: no pause yet
    spinner.record(False)
    assert sum(not spinner.wants() for _ in range(SKIP_MIN + 1)) == SKIP_MIN  # back to the first pause


@pytest.mark.parametrize("budget", [-1e-6, float("nan")])
def test_a_budget_below_zero_or_not_a_number_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="spin budget"):
        Spinner(budget)


def test_a_zero_budget_is_off() -> None:
    assert not Spinner(0.0).enabled
    assert Spinner(1e-6).enabled


def _driver_gen(log: list[Any]) -> Generator[Any, Any, str]:
    """A stand-in for one of psycopg's generators: asks to write, then to read twice."""
    log.append(("got", (yield Wait.W)))
    log.append(("got", (yield Wait.R)))
    log.append(("got", (yield Wait.R)))
    return "result"


def _drive(gen: Generator[Any, Any, Any], answers: dict[Any, Any]) -> tuple[list[Any], Any]:
    """psycopg's waiter, as far as the wrapper sees it: each state yielded gets an answer."""
    asked = []
    try:
        state = next(gen)
        while True:
            asked.append(state)
            state = gen.send(answers[state])
    except StopIteration as stop:
        return asked, stop.value


def test_a_read_answered_while_polling_never_reaches_the_waiter() -> None:
    spinner = Spinner(100e-6)
    spinner.readable = lambda fileno: (lambda: True)  # type: ignore[method-assign]
    log: list[Any] = []
    asked, value = _drive(spinning(_driver_gen(log), 7, spinner), {Wait.W: Ready.W, Wait.R: Ready.R})
    assert value == "result"
    assert asked == [Wait.W]  # only the write went to the waiter
    assert log == [("got", Ready.W), ("got", Ready.R), ("got", Ready.R)]
    assert (spinner.hits, spinner.misses) == (2, 0)


def test_a_read_not_answered_in_time_goes_to_the_waiter_as_it_came() -> None:
    spinner = Spinner(30e-6, clock=FakeClock(10e-6))
    spinner.readable = lambda fileno: (lambda: False)  # type: ignore[method-assign]
    log: list[Any] = []
    asked, value = _drive(spinning(_driver_gen(log), 7, spinner), {Wait.W: Ready.W, Wait.R: Ready.R})
    assert value == "result"
    assert asked == [Wait.W, Wait.R, Wait.R]
    assert log == [("got", Ready.W), ("got", Ready.R), ("got", Ready.R)]
    assert (spinner.hits, spinner.misses) == (0, 2)


def test_an_error_in_the_generator_comes_out_of_the_wrapper() -> None:
    def failing() -> Generator[Any, Any, None]:
        yield Wait.R
        raise RuntimeError("the server went away")

    spinner = Spinner(100e-6)
    spinner.readable = lambda fileno: (lambda: True)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="went away"):
        _drive(spinning(failing(), 7, spinner), {})
