"""outbox_core.backoff: the one back-off formula of the relay, the inbox and the jobs worker."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumer_sdk.jobs.retry import Backoff
from consumer_sdk.model import RetryPolicy
from outbox_core.backoff import backoff_s, ceiling_s


def test_the_ceiling_doubles_from_the_first_failure_up_to_the_cap() -> None:
    assert [ceiling_s(n, initial_s=0.5, max_s=10) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert ceiling_s(0, initial_s=0.5, max_s=10) == 0.5  # attempts below 1 count as the first
    assert [ceiling_s(n, initial_s=1, max_s=100, multiplier=3) for n in (1, 2, 3, 4, 5)] == [1, 3, 9, 27, 81]


def test_jitter_draws_from_the_top_of_the_ceiling_and_rand_picks_where() -> None:
    assert backoff_s(3, initial_s=1, max_s=30, rand=lambda: 0.0) == 4.0
    assert backoff_s(3, initial_s=1, max_s=30, jitter=0.5, rand=lambda: 1.0) == 2.0
    assert backoff_s(3, initial_s=1, max_s=30, jitter=0.25, rand=lambda: 1.0) == 3.0
    assert backoff_s(3, initial_s=1, max_s=30, jitter=0, rand=lambda: 0.7) == 4.0


@given(attempt=st.integers(min_value=-5, max_value=10**6),
       initial_s=st.floats(min_value=0.0, max_value=1e3, allow_nan=False),
       extra_s=st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
       multiplier=st.floats(min_value=1.0, max_value=1e6, allow_nan=False),
       jitter=st.floats(min_value=0.0, max_value=1.0),
       seed=st.integers(min_value=0, max_value=2**32))
def test_a_delay_is_never_negative_never_above_the_cap_and_never_overflows(
        attempt: int, initial_s: float, extra_s: float, multiplier: float, jitter: float, seed: int) -> None:
    max_s = initial_s + extra_s
    rand = random.Random(seed).random
    ceiling = ceiling_s(attempt, initial_s=initial_s, max_s=max_s, multiplier=multiplier)
    delay = backoff_s(attempt, initial_s=initial_s, max_s=max_s, multiplier=multiplier, jitter=jitter, rand=rand)
    assert 0 <= ceiling <= max_s
    assert ceiling * (1 - jitter) - 1e-9 <= delay <= ceiling


def test_a_cap_below_the_start_caps_the_first_wait_too() -> None:
    assert ceiling_s(1, initial_s=5, max_s=1) == 1


@pytest.mark.parametrize("kwargs", [{"initial_s": -1, "max_s": 1}, {"initial_s": 1, "max_s": 2, "multiplier": 0.5}])
def test_nonsense_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ceiling_s(1, **kwargs)
    with pytest.raises(ValueError, match="jitter"):
        backoff_s(1, initial_s=1, max_s=2, jitter=1.5)


def test_the_jobs_backoff_and_the_sdk_retry_policy_are_this_formula() -> None:
    jobs = Backoff(initial_s=1, max_s=10, multiplier=3, jitter=0.4)
    for n in range(1, 6):
        assert jobs.ceiling_s(n) == ceiling_s(n, initial_s=1, max_s=10, multiplier=3)
        assert jobs.delay_s(n, rand=lambda: 0.5) == backoff_s(n, initial_s=1, max_s=10, multiplier=3, jitter=0.4,
                                                             rand=lambda: 0.5)
    policy = RetryPolicy(backoff_initial_s=0.5, backoff_max_s=3, backoff_multiplier=2)
    assert [policy.delay_s(n) for n in range(1, 6)] == [ceiling_s(n, initial_s=0.5, max_s=3) for n in range(1, 6)]
