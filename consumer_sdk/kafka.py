"""The confluent-kafka seam of the dedup consumer: build, read, commit (thin, no policy)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from consumer_sdk.errors import ConfigError, KafkaFatal, KafkaUnavailable
from consumer_sdk.model import KafkaRecord
from consumer_sdk.offsets import TopicPart
from outbox_core.kafka_errors import refusal_text

METADATA_TIMEOUT_S = 10.0

#: librdkafka's own lines (``%3|...|FAIL|...``), for every client the SDK makes: through
#: logging, never raw to stderr.  The SDK configures no logging: a service that does sees
#: them under this name; what they report reaches structlog through the clients' error
#: callbacks (an audit of the security paths found the dead-letter producer's lines raw).
LIBRDKAFKA_LOG = logging.getLogger("consumer_sdk.librdkafka")
LIBRDKAFKA_LOG.addHandler(logging.NullHandler())  # no handler anywhere: dropped, not printed


def record_of(msg: Message) -> KafkaRecord:
    """Detach a confluent-kafka message from the client."""
    raw = msg.headers()
    if not raw:
        headers: tuple[tuple[str, bytes | None], ...] = ()
    elif type(raw) is list and all(type(v) is bytes or v is None for _, v in raw):
        headers = cast("tuple[tuple[str, bytes | None], ...]", tuple(raw))  # librdkafka's pairs, as they are
    else:
        pairs = raw.items() if isinstance(raw, dict) else raw
        headers = tuple((name, value.encode() if isinstance(value, str) else value) for name, value in pairs)
    key, value = msg.key(), msg.value()
    return KafkaRecord(topic=msg.topic() or "", partition=msg.partition() or 0, offset=msg.offset() or 0,
                       key=key.encode() if isinstance(key, str) else key,
                       value=value.encode() if isinstance(value, str) else value, headers=headers)


def build_consumer(config: dict[str, Any]) -> Consumer:
    try:
        return Consumer({"logger": LIBRDKAFKA_LOG, **config})
    except (KafkaException, TypeError, ValueError) as exc:
        raise ConfigError(f"invalid Kafka consumer configuration: {refusal_text(exc, config)}") from None


def access_refused(code: int, topic: str | None, *, group: str, topics: Sequence[str],
                   properties: Mapping[str, Any], text: str) -> str | None:
    """The one line naming the ACL a consumer lacks, when ``code`` says the cluster refused
    its principal its own ``group`` or one of its own ``topics``; None otherwise.

    librdkafka reports both as an error of a poll, once or every few seconds, and goes on
    waiting: a consumer without READ on its group or topic logged them and ran for ever,
    consuming nothing (an audit of the security paths).  ``text`` is librdkafka's, masked."""
    name = properties.get("sasl.username")
    principal = f"User:{name}" if isinstance(name, str) and name else "<its principal>"
    if code == KafkaError.GROUP_AUTHORIZATION_FAILED:
        return (f"the Kafka cluster refused this consumer's principal ({principal}) its consumer group "
                f"{group!r} ({text}): grant it READ on the group (kafka-acls --add --allow-principal "
                f"{principal} --operation Read --group {group})")
    if code == KafkaError.TOPIC_AUTHORIZATION_FAILED and (topic is None or topic in topics):
        what = f"topic {topic!r}" if topic else f"its topics {', '.join(topics)}"
        return (f"the Kafka cluster refused this consumer's principal ({principal}) {what} ({text}): "
                f"grant it READ on the topic, which includes DESCRIBE (kafka-acls --add --allow-principal "
                f"{principal} --operation Read --topic {topic or '<topic>'})")
    return None


def wait_partitions(consumer: Consumer, topic: str, *, stop: threading.Event, log: Any,
                    refused: Callable[[int, str, str], str | None] = lambda *_: None,
                    fatal: Callable[[], str | None] = lambda: None) -> list[int]:
    """The topic's partitions, waiting (until ``stop``) for the topic to exist and the cluster
    to answer; raises :class:`KafkaFatal` when ``refused(code, topic, text)`` reads the
    topic's error as a refusal, or ``fatal()`` names what the client's error callback found
    (a TLS set-up that cannot work: the metadata request itself failed as a raw
    KafkaException out of ``start()`` until an audit of the security paths)."""
    logged = False
    while not stop.is_set():
        try:
            meta = consumer.list_topics(topic=topic, timeout=METADATA_TIMEOUT_S).topics.get(topic)
        except KafkaException as exc:
            meta, problem = None, str(exc.args[0].str() if exc.args else exc)
            consumer.poll(0)  # serves the error callback: a consumer's list_topics does not
        else:
            problem = "no such topic"
        if (why := fatal()) is not None:
            raise KafkaFatal(why)
        if meta is not None and meta.error is None and meta.partitions:
            return sorted(meta.partitions)
        if meta is not None and meta.error is not None:
            why = refused(meta.error.code(), topic, meta.error.str())
            if why is not None:
                raise KafkaFatal(why)
        if not logged:
            log.warning("topic_missing", topic=topic, error=problem,
                        hint="waiting for it to be created and the cluster to answer")
            logged = True
        stop.wait(1.0)
    return []


def require_topics(consumer: Consumer, topics: list[str], *, what: str, hint: str) -> None:
    """Raise :class:`ConfigError` naming the ``topics`` the cluster does not have.

    Lists every topic (no per-topic request, which could create one on a broker that
    auto-creates topics)."""
    try:
        known = consumer.list_topics(timeout=METADATA_TIMEOUT_S).topics
    except KafkaException as exc:
        raise KafkaUnavailable(f"cannot list the cluster's topics to check the {what}s: {exc}") from None
    missing = [t for t in topics if t not in known or known[t].error is not None]
    if missing:
        raise ConfigError(f"{what} {', '.join(missing)} does not exist: {hint}")


@dataclass(frozen=True)
class CommitError:
    """One error of an offset commit: librdkafka's ``code`` (a ``KafkaError`` code, None when the
    client raised without one) for the caller's decisions, and ``text`` (``topic[partition]:
    KafkaError{code=...,str=...}``) for a person reading the log.  The caller decided from the
    text before (the code read back out of it)."""

    code: int | None
    text: str

    def __str__(self) -> str:
        return self.text


def commit_offsets(consumer: Consumer, offsets: dict[TopicPart, int]) -> tuple[dict[TopicPart, int], list[CommitError]]:
    """Commit synchronously; returns (acknowledged positions, errors).  Never raises."""
    try:
        answer = consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                 asynchronous=False) or []
    except KafkaException as exc:
        error = exc.args[0] if exc.args else exc
        code = error.code() if isinstance(error, KafkaError) else None
        return {}, [CommitError(code, str(error))]
    done: dict[TopicPart, int] = {}
    errors: list[CommitError] = []
    for tp in answer:
        if tp.error is None:
            done[(tp.topic, tp.partition)] = tp.offset
        else:
            errors.append(CommitError(tp.error.code(), f"{tp.topic}[{tp.partition}]: {tp.error}"))
    return done, errors


def seek(consumer: Consumer, key: TopicPart, offset: int, *, log: Any) -> bool:
    """Move the partition's fetch position to ``offset`` (dropping what was prefetched)."""
    try:
        consumer.seek(TopicPartition(key[0], key[1], offset))
    except KafkaException as exc:  # not assigned any more: its next owner starts from the commit
        log.warning("seek_failed", topic=key[0], partition=key[1], offset=offset, error=str(exc))
        return False
    return True


def high_watermark(consumer: Consumer, key: TopicPart) -> int | None:
    """The partition's high watermark as last seen by fetches (no broker round trip)."""
    try:
        _low, high = consumer.get_watermark_offsets(TopicPartition(key[0], key[1]), cached=True)
    except KafkaException:
        return None
    return high if high is not None and high >= 0 else None


def names(partitions: list[TopicPartition]) -> list[str]:
    return [f"{tp.topic}[{tp.partition}]" for tp in partitions]
