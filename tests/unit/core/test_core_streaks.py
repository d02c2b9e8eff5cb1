"""outbox_core.streaks: a streak of failures said at its first, at a change of kind and every
``every_s`` after, its end with the count and how long it lasted (pure: the time is passed in)."""

from __future__ import annotations

import math

from outbox_core.streaks import FailureStreak


def test_a_streak_is_said_at_its_first_failure_then_every_interval_and_its_end_counts_it() -> None:
    streak = FailureStreak(every_s=30.0)
    assert streak.passed(5.0) == (0, 0.0)  # none under way: nothing to end
    said = [now for now in range(10, 80, 5) if streak.failed(float(now))]
    assert said == [10, 40, 70]  # the first, then 30 s after the last line, not sooner
    assert streak.failures == 14 and streak.began == 10.0
    assert streak.passed(76.5) == (14, 66.5)
    assert streak.failures == 0 and streak.passed(77.0) == (0, 0.0)  # ended once
    assert streak.failed(100.0)  # the next streak is said again, from its first failure
    assert streak.passed(101.0) == (1, 1.0)


def test_another_kind_is_said_at_once_and_restarts_the_interval() -> None:
    streak = FailureStreak(every_s=30.0)
    assert streak.failed(0.0, kind="unreachable")
    assert not streak.failed(1.0, kind="unreachable")
    assert streak.failed(2.0, kind="read-only")  # the cause changed
    assert not streak.failed(3.0, kind="read-only")
    assert not streak.failed(31.0, kind="read-only")  # 29 s after the last line
    assert streak.failed(32.0, kind="read-only")
    assert streak.failures == 6 and streak.began == 0.0


def test_a_streak_begins_when_its_first_failed_attempt_began() -> None:
    streak = FailureStreak(every_s=30.0)
    assert streak.failed(12.0, began=10.0)  # an attempt that took 2 s to fail
    assert not streak.failed(20.0, began=15.0)  # later attempts do not move its start
    assert streak.began == 10.0
    assert not streak.failed(41.9)  # the interval counts from the line (12 s), not the start
    assert streak.failed(42.0)
    assert streak.passed(50.0) == (4, 40.0)


def test_an_endless_interval_says_a_streak_at_its_first_failure_only() -> None:
    streak = FailureStreak(every_s=math.inf)
    assert [streak.failed(float(now)) for now in (0, 1e6, 1e9)] == [True, False, False]
