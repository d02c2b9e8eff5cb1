"""What the Kafka client's errors and delivery reports mean to the relay: outcomes and broker states.

A produced row's delivery report (or the client's refusal at ``produce()``) becomes an
:class:`Outcome` (:func:`classify`, :func:`refused_at_produce`): acknowledged, retried,
permanent, hopeless or fatal to the producer.  A client error (librdkafka's ``error_cb``)
says a :class:`BrokerState`.  The client itself is relay/publisher.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from confluent_kafka import KafkaError

from outbox_core.kafka_errors import SETUP_CODES

#: Broker or client errors that no retry can fix for this row.
PERMANENT_CODES: dict[int, str] = {
    KafkaError.MSG_SIZE_TOO_LARGE: "message_too_large",
    KafkaError.RECORD_LIST_TOO_LARGE: "message_too_large",
    KafkaError.INVALID_RECORD: "record_rejected",
    KafkaError.INVALID_MSG: "record_rejected",
    KafkaError.POLICY_VIOLATION: "record_rejected",
    KafkaError.TOPIC_EXCEPTION: "invalid_topic",
    KafkaError.UNKNOWN_TOPIC_OR_PART: "unknown_topic",
    KafkaError._UNKNOWN_TOPIC: "unknown_topic",
    KafkaError._UNKNOWN_PARTITION: "unknown_topic",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "topic_not_authorized",
    KafkaError.INVALID_MSG_SIZE: "message_too_large",
}

#: Client errors that mean the configuration is wrong: the process stops with a clear line
#: (outbox_core.kafka_errors.setup_failure decides the rest, for the SDK too).
FATAL_CLIENT_CODES = {
    **SETUP_CODES,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "this principal may not produce (cluster authorization)",
}

#: Client errors that mean every broker is gone right now.
UNREACHABLE_CODES = {KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._RESOLVE}


class BrokerState(StrEnum):
    """What a client error (librdkafka's ``error_cb``) says about the Kafka cluster."""

    CONFIG = "config"            # the configuration is wrong (FATAL_CLIENT_CODES): the process stops
    FATAL = "fatal"              # librdkafka's fatal error: the producer cannot go on
    UNREACHABLE = "unreachable"  # every broker is gone right now (UNREACHABLE_CODES): waited for
    ERROR = "error"              # anything else: librdkafka retries on its own


@dataclass(frozen=True, slots=True)
class Outcome:
    """The fate of one produced row."""

    ok: bool
    error_class: str = ""  # e.g. "message_too_large", "timeout", "transient"
    message: str = ""
    permanent: bool = False
    fatal: bool = False  # the producer itself is unusable (idempotence fatal error)
    hopeless: bool = False  # no attempt can ever succeed: dead-letter without retrying
    partition: int = -1
    offset: int = -1

#: The outcome of every acknowledged row: one shared value (nothing reads an acknowledged
#: row's partition or offset), not a new frozen dataclass per delivery report.
DELIVERED = Outcome(ok=True)

#: ``send``'s answer when the producer's local queue has no room: not a failure of the
#: row; the pump stops producing the batch and claims the rest again later.
QUEUE_FULL = Outcome(ok=False, error_class="queue_full",
                     message="the producer's local queue is full")


#: The broker no longer accepts this producer's id or epoch (after messages timed out
#: during an outage, say): only a new producer gets out of it.
PRODUCER_STATE_CODES = {KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH,
                        KafkaError._FENCED, KafkaError.UNKNOWN_PRODUCER_ID,
                        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
                        KafkaError.INVALID_PRODUCER_ID_MAPPING}


def classify(error: KafkaError) -> Outcome:
    code = error.code()
    message = error.str()
    if error.fatal() or code in PRODUCER_STATE_CODES:
        return Outcome(ok=False, error_class="producer_fatal", message=message, fatal=True)
    if code in PERMANENT_CODES:
        return Outcome(ok=False, error_class=PERMANENT_CODES[code], message=message, permanent=True)
    if code == KafkaError._MSG_TIMED_OUT:
        return Outcome(ok=False, error_class="timeout", message=message)
    return Outcome(ok=False, error_class="transient", message=message)


def refused_at_produce(error: KafkaError) -> Outcome:
    """The outcome of a record the client refused in ``produce()`` itself.

    A size refusal there is the record's own (its size with the record's overhead, or a jsonb
    payload whose text is far longer than its stored size, escapes included): no record batch
    shares the blame.  Taken for a batch's, the row was sent alone again and again, a
    transient back-off each time, for ever (an audit with hostile rows): hopeless instead."""
    outcome = classify(error)
    if outcome.error_class != "message_too_large":
        return outcome
    return Outcome(ok=False, error_class="message_too_large", permanent=True, hopeless=True,
                   message=f"{outcome.message}: the client refused it at produce "
                           "(over message.max.bytes with the record's overhead)")

