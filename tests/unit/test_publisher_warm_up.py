"""Publisher.warm_up asks the cluster at a bounded pace, whatever the client answers.

A client that refuses at once (an error raised without waiting) or a bootstrap broker
that answers at once (``orig_broker_id`` -1) had the loop ask again at once: thousands
of metadata requests, a core spun for the whole warm-up (2 s at every start)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay.publisher import Publisher


class Producer:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def list_topics(self, timeout: float) -> Any:
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def publisher(answer: Any) -> tuple[Any, Producer]:
    pub: Any = object.__new__(Publisher)  # no librdkafka client: only list_topics is asked
    producer = Producer(answer)
    pub._producer = producer
    return pub, producer


@pytest.mark.parametrize("answer", [
    KafkaException(KafkaError(KafkaError._TRANSPORT)),
    SimpleNamespace(orig_broker_id=-1),
], ids=["refused-at-once", "bootstrap-answer"])
def test_an_answer_that_comes_at_once_is_asked_again_at_a_bounded_pace(answer: Any) -> None:
    pub, producer = publisher(answer)
    timeout_s = 0.3
    started = time.monotonic()
    assert pub.warm_up(timeout_s) is False
    took = time.monotonic() - started
    assert timeout_s <= took < timeout_s + 0.2
    assert 2 <= producer.calls <= 40  # at most one request every 10 ms (WARM_UP_STEP_S)


def test_a_broker_that_answers_ends_the_warm_up_at_once() -> None:
    pub, producer = publisher(SimpleNamespace(orig_broker_id=1))
    started = time.monotonic()
    assert pub.warm_up(5.0) is True
    assert producer.calls == 1
    assert time.monotonic() - started < 1.0


def test_stopping_ends_the_warm_up_before_the_next_request() -> None:
    pub, producer = publisher(SimpleNamespace(orig_broker_id=-1))
    assert pub.warm_up(5.0, stopping=lambda: producer.calls >= 3) is False
    assert producer.calls == 3
