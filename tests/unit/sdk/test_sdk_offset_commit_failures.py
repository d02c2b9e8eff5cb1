"""A failed offset commit is logged by what failed it: the group moving on under the commit
(a rebalance in progress, this member's generation or epoch gone) is expected during a
cooperative rebalance and logged as info, saying why nothing is lost; anything else stays a
warning.  Both count in ``outbox_consumer_offset_commit_failures_total`` (no sockets: the
scripted fake Kafka client of test_sdk_consumer_loop)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from structlog.testing import capture_logs

from consumer_sdk import kafka as kafka_seam
from consumer_sdk.inbox_offsets import group_moved_on
from tests.unit.sdk.test_sdk_consumer_loop import FakeKafka, build, records


class RefusingKafka(FakeKafka):
    """Fails the first commit with ``code``, as the broker or the client answers it."""

    code = KafkaError.REBALANCE_IN_PROGRESS

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[TopicPartition]:
        if self.fail_commits:
            self.fail_commits -= 1
            raise KafkaException(KafkaError(self.code))
        return super().commit(offsets, asynchronous)


@pytest.fixture
def refusing(journal: list[Any], monkeypatch: pytest.MonkeyPatch) -> RefusingKafka:
    fake = RefusingKafka(journal)
    monkeypatch.setattr(kafka_seam, "build_consumer", lambda config: fake)
    return fake


@pytest.fixture
def journal() -> list[Any]:
    return []


@pytest.mark.parametrize(("code", "level"), [
    (KafkaError.REBALANCE_IN_PROGRESS, "info"),
    (KafkaError.ILLEGAL_GENERATION, "info"),
    (KafkaError.UNKNOWN_MEMBER_ID, "info"),
    (KafkaError.STALE_MEMBER_EPOCH, "info"),
    (KafkaError.COORDINATOR_NOT_AVAILABLE, "warning"),
    (KafkaError.GROUP_AUTHORIZATION_FAILED, "warning"),
    (KafkaError._TIMED_OUT, "warning"),
])
def test_a_commit_failed_by_a_rebalance_is_info_and_any_other_a_warning(journal, refusing, code, level):
    refusing.queue = records(0, 1)
    refusing.code = code
    refusing.fail_commits = 1
    consumer = build(journal, lambda conn, message: None)
    with capture_logs() as logs:
        consumer.run_once()
    [failed] = [e for e in logs if e["event"] == "offset_commit_failed"]
    assert failed["log_level"] == level
    assert KafkaError(code).name() in failed["errors"][0]
    assert ("nothing is lost" in failed.get("detail", "")) == (level == "info")
    assert consumer.metrics.registry.get_sample_value(
        "outbox_consumer_offset_commit_failures_total", {"consumer": "svc"}) == 1


def test_a_rebalance_among_other_errors_is_still_a_warning():
    moved = f"orders[0]: {KafkaError(KafkaError.ILLEGAL_GENERATION)}"
    other = f"orders[1]: {KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)}"
    assert group_moved_on([moved, moved])
    assert not group_moved_on([moved, other])
    assert not group_moved_on([])  # nothing to say it was a rebalance
    assert not group_moved_on(["a text without a code (ILLEGAL_GENERATION)"])
