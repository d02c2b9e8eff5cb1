"""``InboxConfig.keep_membership_max_intervals``: how many ``max.poll.interval.ms`` the keeper
polls beside one transaction before it lets the member leave its group (a hung handler's
partitions go to other members).  It was a constant (3); now a setting, checked like the
others.  Against the scripted fake client of the consumer-loop tests and a stepped clock
(no sockets)."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from consumer_sdk import ConfigError, InboxConfig, InboxConsumer
from consumer_sdk import kafka as kafka_seam
from consumer_sdk.config import DEFAULT_KEEP_MEMBERSHIP_MAX_INTERVALS, MAX_KEEP_MEMBERSHIP_INTERVALS
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.testing import FakeDeadLetters
from tests.unit.sdk.test_sdk_consumer_loop import TOPIC, FakeKafka, JournalStore


def config(**overrides: Any) -> InboxConfig:
    return InboxConfig(**{"name": "svc", "dsn": "postgresql://unused", "bootstrap_servers": "k:1",
                          "topics": [TOPIC], "check_retention": False, "inbox_retention_s": None, **overrides})


def test_the_default_is_three_intervals() -> None:
    assert config().keep_membership_max_intervals == DEFAULT_KEEP_MEMBERSHIP_MAX_INTERVALS == 3


@pytest.mark.parametrize("value", [0, -1, MAX_KEEP_MEMBERSHIP_INTERVALS + 1, 2.5, True, None, "3"])
def test_a_value_that_is_no_int_in_range_is_refused_naming_the_option(value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        config(keep_membership_max_intervals=value)
    assert str(caught.value) == (f"keep_membership_max_intervals (of max.poll.interval.ms) must be an integer "
                                 f"from 1 to {MAX_KEEP_MEMBERSHIP_INTERVALS:,}, got {value!r}")


@pytest.mark.parametrize("intervals", [1, 5])
def test_the_keeper_lets_go_after_the_configured_intervals(intervals: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transaction that never hands the consumer back; each keeper poll moves the clock one
    ``max.poll.interval.ms`` on: the keeper gives up after ``intervals`` polls, not 3."""
    journal: list[Any] = []
    fake = FakeKafka(journal)
    monkeypatch.setattr(kafka_seam, "build_consumer", lambda config: fake)
    settings = config(assignment="subscribe", keep_membership_max_intervals=intervals)
    now = [0.0]
    consumer = InboxConsumer(settings, lambda conn, message: None, metrics=ConsumerMetrics(),
                             dead_letters=FakeDeadLetters(), clock=lambda: now[0])
    consumer.store = JournalStore(journal)  # type: ignore[assignment]
    consumer._consumer = fake  # type: ignore[assignment]  # the keeper's session alone, not the loop

    def one_interval_later() -> None:
        now[0] += settings.max_poll_interval_s()
        fake.on_poll.append(one_interval_later)

    fake.on_poll.append(one_interval_later)
    with capture_logs() as logs:
        assert consumer._keep_beside(lambda: False) is True  # gave up
    assert journal.count("poll") == intervals
    [released] = [e for e in logs if e["event"] == "membership_released"]
    assert f"ran {intervals} x max.poll.interval.ms" in released["hint"]
