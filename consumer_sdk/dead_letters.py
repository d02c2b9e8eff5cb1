"""The dead-letter topic: the :class:`~consumer_sdk.rejections.DeadLetterSink` adapter for Kafka.

A dead letter keeps the original key, value and headers (``event_id`` included,
so a replay is deduplicated by the inbox) and adds ``dlq_*`` headers saying why
it is there.  :meth:`KafkaDeadLetters.send` returns only once the broker
acknowledged the letter (idempotent producer, ``acks=all``); only then may the
consumer commit the original's offset.  A crash in between sends the letter
again: the dead-letter topic is at-least-once, like the relay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from consumer_sdk.errors import ConfigError, DeadLetterFailed
from consumer_sdk.kafka import LIBRDKAFKA_LOG
from consumer_sdk.model import DeadLetter
from outbox_core.kafka_clients import destroy_producer
from outbox_core.kafka_errors import refusal_text
from outbox_core.secrets import scrub

REQUIRED_PRODUCER = {"enable.idempotence": True, "acks": "all"}
DLQ_HEADER_PREFIX = "dlq_"


def dead_letter_headers(letter: DeadLetter) -> list[tuple[str, str | bytes | None]]:
    """The original headers, then the ``dlq_*`` ones (original ``dlq_*`` headers are dropped)."""
    record = letter.record
    headers: list[tuple[str, str | bytes | None]] = [
        (name, value) for name, value in record.headers if not name.startswith(DLQ_HEADER_PREFIX)]
    extra = {
        "dlq_reason": letter.reason,
        "dlq_error": letter.error,
        "dlq_error_type": letter.error_type,
        "dlq_attempts": str(letter.attempts),
        "dlq_consumer": letter.consumer,
        "dlq_source_topic": record.topic,
        "dlq_source_partition": str(record.partition),
        "dlq_source_offset": str(record.offset),
    }
    # backslashreplace: an error's text may hold lone surrogates (rejections.describe writes
    # them as escapes; a DeadLetter built elsewhere may not): never a crash at the letter.
    headers.extend((name, value.encode("utf-8", "backslashreplace")) for name, value in extra.items())
    return headers


def dead_letter_topic(template: str, source_topic: str) -> str:
    """The dead-letter topic of ``source_topic``: ``template`` with ``{topic}`` filled in."""
    return template.replace("{topic}", source_topic)


class KafkaDeadLetters:
    """Sends dead letters synchronously (they are rare); owns one producer."""

    def __init__(self, config: Mapping[str, Any], *, topic_template: str, timeout_s: float) -> None:
        self._template = topic_template
        self._timeout_s = timeout_s
        self._config = {"logger": LIBRDKAFKA_LOG, **config, **REQUIRED_PRODUCER, "error_cb": self._on_error}
        self._last_error = ""  # the client's last error (a refused connection, say), masked
        #: librdkafka's fatal error: the producer can never send again (an idempotent producer
        #: refused its producer id, a principal without IdempotentWrite).  It is replaced at the
        #: next send, so a letter goes once the cause is fixed (the runbook's promise); kept, the
        #: partition stayed paused until a restart (an audit of the security paths).
        self._fatal = False
        self._closed = False
        try:
            self._producer = Producer(self._config)
        except (KafkaException, TypeError, ValueError) as exc:
            raise ConfigError("invalid Kafka configuration for the dead-letter producer: "
                              f"{refusal_text(exc, self._config)}") from None

    def _on_error(self, err: KafkaError) -> None:
        self._last_error = scrub(err.str(), properties=self._config)
        if err.fatal():
            self._fatal = True

    def send(self, letter: DeadLetter) -> None:
        """Produce ``letter`` and wait for its acknowledgement; :class:`DeadLetterFailed` otherwise."""
        outcome: list[KafkaError | None] = []

        def report(err: KafkaError | None, _msg: Message) -> None:
            outcome.append(err)

        if self._closed:
            raise RuntimeError("the dead-letter producer is closed")
        if self._fatal:
            self._fatal = False
            destroy_producer(self._producer)  # it can send nothing
            self._producer = Producer(self._config)
        topic = dead_letter_topic(self._template, letter.record.topic)
        try:
            self._producer.produce(topic, key=letter.record.key, value=letter.record.value,
                                   headers=dead_letter_headers(letter), on_delivery=report)
        except (KafkaException, BufferError) as exc:
            if isinstance(exc, KafkaException) and exc.args[0].fatal():
                self._fatal = True
            raise DeadLetterFailed(f"cannot queue a dead letter for {topic}: {exc}") from exc
        try:
            self._producer.flush(self._timeout_s)
        except Exception as exc:  # noqa: BLE001 - confluent-kafka raised SystemError at a fatal error
            self._fatal = True
            cause = exc.__cause__ or exc.__context__ or exc
            raise DeadLetterFailed(f"dead letter to {topic} failed: {cause}") from exc
        if not outcome:
            last = f" (the client's last error: {self._last_error})" if self._last_error else ""
            raise DeadLetterFailed(f"no acknowledgement for a dead letter to {topic} within {self._timeout_s}s{last}")
        if outcome[0] is not None:
            if outcome[0].fatal():
                self._fatal = True
            raise DeadLetterFailed(f"dead letter to {topic} failed: {outcome[0].str()}")

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait up to ``timeout_s`` for what is queued, then destroy the client.  Idempotent."""
        if not self._closed:
            self._closed = True
            # Destroyed here, its threads joined: left to the garbage collector (its error
            # callback holds this object: a cycle), it went on reconnecting to the cluster.
            destroy_producer(self._producer, timeout_s)
