"""The producer's poll gets at least a whole millisecond for any positive wait.

confluent-kafka truncates a poll timeout to whole milliseconds: a wait of 0.4 ms was a
poll(0) that returned at once, and the pump's wait loop spun through such polls for
the last fraction of every millisecond before a paced claim."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from relay.publisher import Publisher


class Producer:
    """Records each timeout as librdkafka receives it: int(seconds * 1000)."""

    def __init__(self) -> None:
        self.waits_ms: list[int] = []

    def poll(self, timeout: float) -> int:
        self.waits_ms.append(int(timeout * 1000.0))
        return 0


def publisher() -> tuple[Any, Producer]:
    pub: Any = object.__new__(Publisher)  # no librdkafka client: only poll is exercised
    producer = Producer()
    pub._producer = producer
    return pub, producer


def test_a_sub_millisecond_wait_is_not_a_poll_that_returns_at_once() -> None:
    pub, producer = publisher()
    for timeout_s in (0.0004, 0.0009, 0.000_001):
        pub.poll(timeout_s)
    assert producer.waits_ms == [1, 1, 1]


def test_zero_stays_a_non_blocking_poll() -> None:
    pub, producer = publisher()
    pub.poll(0)
    pub.poll(-1.0)
    assert producer.waits_ms == [0, 0]


@given(st.floats(min_value=1e-6, max_value=60.0, allow_nan=False))
def test_the_wait_is_the_timeout_rounded_up_to_a_millisecond(timeout_s: float) -> None:
    pub, producer = publisher()
    pub.poll(timeout_s)
    (waited,) = producer.waits_ms
    assert timeout_s * 1000.0 - 1e-6 <= waited <= timeout_s * 1000.0 + 1.0
