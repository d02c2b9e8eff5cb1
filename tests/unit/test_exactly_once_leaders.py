"""Which partitions have no leader (relay/exactly_once_leaders.py), asked on the pump's thread
during a stall in exactly-once mode.  The metadata client is faked (pure logic of how often it
is asked); the real cluster case is tests/integration/kafka/test_exactly_once_cluster.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay import exactly_once_leaders
from relay.exactly_once_leaders import LEADERS_CLEAR_TTL_S, LEADERS_TTL_S, Leaders


class Admin:
    """A metadata client whose brokers answer (``leaders``: topic -> {partition: leader}) or not."""

    calls: list[str] = []
    answering = True
    leaders: dict[str, dict[int, int]] = {}

    def __init__(self, _config: dict[str, Any]) -> None:
        pass

    def list_topics(self, topic: str, timeout: float) -> Any:
        Admin.calls.append(topic)
        if not Admin.answering:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        partitions = {p: SimpleNamespace(leader=leader) for p, leader in Admin.leaders.get(topic, {}).items()}
        return SimpleNamespace(topics={topic: SimpleNamespace(partitions=partitions)} if partitions else {})


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch) -> type[Admin]:
    Admin.calls, Admin.answering, Admin.leaders = [], True, {}
    monkeypatch.setattr(exactly_once_leaders, "AdminClient", Admin)
    return Admin


def test_each_topic_is_asked_at_most_once_a_ttl(admin: type[Admin]) -> None:
    now = [100.0]
    leaders = Leaders({"bootstrap.servers": "x"}, clock=lambda: now[0])
    admin.leaders = {"a": {0: -1, 1: 2}, "b": {0: 1}}
    assert leaders.leaderless("a") == frozenset({0}) and leaders.leaderless("b") == frozenset()
    assert leaders.leaderless("a") == frozenset({0}) and admin.calls == ["a", "b"]
    now[0] += LEADERS_TTL_S
    admin.leaders = {"a": {0: 3, 1: 2}}
    assert leaders.leaderless("a") == frozenset() and admin.calls == ["a", "b", "a"]
    assert leaders.leaderless("gone") is None  # a topic the metadata does not know


def test_brokers_that_do_not_answer_hold_the_pump_once_not_once_per_topic(admin: type[Admin]) -> None:
    # Every broker out of reach: each request waits out its timeout on the pump's thread, which
    # runs the lease heartbeats too.  One topic after the other, twenty topics with rows
    # waiting held it twenty timeouts every few seconds.
    now = [100.0]
    leaders = Leaders({"bootstrap.servers": "x"}, clock=lambda: now[0])
    admin.answering = False
    assert [leaders.leaderless(f"t{i}") for i in range(20)] == [None] * 20
    assert admin.calls == ["t0"]
    now[0] += LEADERS_TTL_S
    admin.answering = True
    admin.leaders = {"t5": {0: -1}}
    assert leaders.leaderless("t5") == frozenset({0}) and admin.calls == ["t0", "t5"]


def test_an_answer_naming_no_partition_without_a_leader_is_asked_again_sooner(admin: type[Admin]) -> None:
    # A dead broker stays its partitions' leader until the controller fences it: trusted for
    # LEADERS_TTL_S, such an answer kept the stall tracker from naming the leaderless partition.
    now = [100.0]
    leaders = Leaders({"bootstrap.servers": "x"}, clock=lambda: now[0])
    admin.leaders = {"a": {0: 1, 1: 2}}
    assert leaders.leaderless("a") == frozenset()
    admin.leaders = {"a": {0: -1, 1: 2}}  # fenced
    now[0] += LEADERS_CLEAR_TTL_S
    assert leaders.leaderless("a") == frozenset({0}) and admin.calls == ["a", "a"]
    now[0] += LEADERS_CLEAR_TTL_S  # an answer naming one is trusted the whole TTL
    assert leaders.leaderless("a") == frozenset({0}) and admin.calls == ["a", "a"]
