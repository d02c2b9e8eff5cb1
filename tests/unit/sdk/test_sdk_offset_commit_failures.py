"""A failed offset commit is logged by what failed it: the group moving on under the commit
(a rebalance in progress, this member's generation or epoch gone) is expected during a
cooperative rebalance and logged as info, saying why nothing is lost; anything else stays a
warning.  Both count in ``outbox_consumer_offset_commit_failures_total`` (no sockets: the
scripted fake Kafka client of test_sdk_consumer_loop)."""

from __future__ import annotations

from types import SimpleNamespace
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
    assert failed["errors"] == [str(KafkaError(code))]  # for a person: librdkafka's text, as before
    assert ("nothing is lost" in failed.get("detail", "")) == (level == "info")
    assert consumer.metrics.registry.get_sample_value(
        "outbox_consumer_offset_commit_failures_total", {"consumer": "svc"}) == 1


class AnsweringKafka:
    """A consumer whose commit answers each partition with its own error (or none)."""

    def __init__(self, errors: dict[int, KafkaError | None]) -> None:
        self.errors = errors

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[SimpleNamespace]:
        return [SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=tp.offset,
                                error=self.errors[tp.partition]) for tp in offsets]


def test_commit_offsets_reports_each_partitions_error_by_its_code_and_text():
    moved = KafkaError(KafkaError.ILLEGAL_GENERATION)
    consumer: Any = AnsweringKafka({0: None, 1: moved})
    done, errors = kafka_seam.commit_offsets(consumer, {("orders", 0): 7, ("orders", 1): 9})
    assert done == {("orders", 0): 7}
    assert errors == [kafka_seam.CommitError(KafkaError.ILLEGAL_GENERATION, f"orders[1]: {moved}")]
    assert str(errors[0]) == f"orders[1]: {moved}"


def test_a_rebalance_among_other_errors_is_still_a_warning():
    moved = kafka_seam.CommitError(KafkaError.ILLEGAL_GENERATION, "orders[0]: a rebalance")
    other = kafka_seam.CommitError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "orders[1]: refused")
    assert group_moved_on([moved, moved])
    assert not group_moved_on([moved, other])
    assert not group_moved_on([])  # nothing to say it was a rebalance
    assert not group_moved_on([kafka_seam.CommitError(None, "a client error without a code")])


def test_the_decision_reads_the_code_not_the_text():
    """A text that names a rebalance code does not make it one (the code decided from the text before)."""
    assert not group_moved_on([kafka_seam.CommitError(
        KafkaError._TIMED_OUT, "KafkaError{code=ILLEGAL_GENERATION,val=22,str=\"quoted by a proxy\"}")])
    assert group_moved_on([kafka_seam.CommitError(KafkaError.FENCED_MEMBER_EPOCH, "no code in this text")])
