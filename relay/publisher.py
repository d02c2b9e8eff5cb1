"""The Kafka side: produce rows, turn delivery reports into outcomes (relay/outcomes.py).

Only this module and relay/kafka_producer.py (the client made, warmed up and closed)
import confluent_kafka for producing.  The producer is
idempotent with ``acks=all`` (see :func:`relay.kafka_config.producer_config`), so
messages of one partition are written in the order they were produced, without
duplicates from the producer's own retries.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from outbox_core.kafka_clients import destroy_producer
from outbox_core.kafka_errors import TlsListenerProbe, setup_failure
from outbox_core.secrets import scrub
from relay.kafka_producer import _CLOSED, WARM_UP_TIMEOUT_S, await_cluster, new_producer
from relay.model import OutboxRow

# What the client's errors and reports mean lives in relay/outcomes.py; the names the tests
# import from here are re-exported.
from relay.outcomes import (
    DELIVERED,
    FATAL_CLIENT_CODES,
    PERMANENT_CODES,
    QUEUE_FULL,
    UNREACHABLE_CODES,
    classify,
    refused_at_produce,
)
from relay.outcomes import BrokerState as BrokerState
from relay.outcomes import Outcome as Outcome
from relay.stalls import default_partition

#: A dead letter over the size limit (Publisher._produce_dead_letter), sent again without its value.
_TOO_LARGE = "too large"
_SIZE_CODES = frozenset(code for code, name in PERMANENT_CODES.items() if name == "message_too_large")


class BadRow(ValueError):
    """The row cannot be encoded as a Kafka message."""


def poll_timeout(timeout_s: float) -> float:
    """``timeout_s`` as the producer's ``poll`` should get it: rounded up to whole
    milliseconds, each passed as its middle.

    confluent-kafka truncates a poll's timeout to whole milliseconds, so a wait of less
    than one returned at once: a loop waiting out the last fraction of a millisecond
    before a paced claim spun through a poll call each time, about 17 per claim at a
    steady 1,000 events/s."""
    if timeout_s <= 0:
        return 0.0
    return (math.ceil(timeout_s * 1000.0 - 1e-9) + 0.5) / 1000.0


def encode_headers(row: OutboxRow) -> list[tuple[str, str | bytes | None]]:
    """The row's JSON headers as Kafka headers, plus ``event_id`` always.

    Header values must be strings (or null); anything else is a bad row, since
    guessing an encoding would hand consumers bytes nobody agreed on.
    """
    if not row.headers_json or row.headers_json == "{}":
        return [("event_id", row.event_id.encode())]
    try:
        headers = json.loads(row.headers_json)
    except ValueError as exc:
        raise BadRow(f"headers are not valid JSON: {exc}") from None
    except RecursionError:  # jsonb nests deeper than Python's json can follow
        raise BadRow("headers are nested too deeply to decode") from None
    if not isinstance(headers, dict):
        raise BadRow("headers must be a JSON object of strings")
    encoded: list[tuple[str, str | bytes | None]] = []
    for name, value in headers.items():
        if name == "event_id":
            continue
        if value is None:
            encoded.append((name, None))
        elif isinstance(value, str):
            encoded.append((name, value.encode()))
        else:
            raise BadRow(f"header {name!r} must be a string, not {type(value).__name__}")
    encoded.append(("event_id", row.event_id.encode()))
    return encoded


PARTITIONS_TTL_S = 60.0  # how long a topic's partition count is trusted
PARTITIONS_UNKNOWN_S = 5.0  # how long partition_of trusts a failed lookup (no partition known)
PARTITIONS_TIMEOUT_S = 1.0  # a metadata request for it; only when a partition looks stalled

DeliveryCallback = Callable[[OutboxRow, Outcome], None]
ErrorCallback = Callable[[BrokerState, str, bool], None]  # (state, message, fatal)


class Publisher:
    """Owns one confluent-kafka Producer.  Not thread-safe: the pump's thread calls it, but
    :meth:`partitions_now` (the partition watch's thread, relay/topic_partitions.py)."""

    _answered = False  # a broker answered this client (warm_up): transport errors may be passing
    _tls_probe: TlsListenerProbe | None = None  # a plaintext client facing a TLS listener

    def __init__(self, config: dict[str, str], *, on_client_error: ErrorCallback,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = dict(config)
        self._tls_probe = TlsListenerProbe(self._config)
        self._on_client_error = on_client_error
        self._producer = self._new_producer()
        self._closed = False
        self._clock = clock
        # Kafka's default partitioner, which relay.stalls can compute: murmur2 of the key.
        self._murmur2 = self._config.get("partitioner", "consistent_random") in (
            "murmur2", "murmur2_random")
        self._partitions: dict[str, tuple[int | None, float]] = {}  # topic -> (count, until)
        # Held by partitions_now's metadata request on another thread, and by recreate and
        # close while they destroy the client: librdkafka's handle must not be destroyed
        # under a call in progress on it.  send, poll and partition_of never take it.
        self._client_lock = threading.Lock()

    def _new_producer(self) -> Producer:
        return new_producer(self._config, self._error_cb)

    def _error_cb(self, error: KafkaError) -> None:
        code = error.code()
        # librdkafka's text may quote a secret property's value (a malformed
        # sasl.oauthbearer.config, from where its parsing stopped): masked as in the logs.
        text = scrub(error.str(), properties=self._config)
        failure = setup_failure(code, text, answered=self._answered)
        if failure is None and self._tls_probe is not None:
            failure = self._tls_probe.failure(code, text, answered=self._answered)
        if failure is None and code in FATAL_CLIENT_CODES:
            failure = f"{FATAL_CLIENT_CODES[code]}: {text}"
        if failure is not None:
            self._on_client_error(BrokerState.CONFIG, failure, True)
        elif error.fatal():
            self._on_client_error(BrokerState.FATAL, text, False)
        elif code in UNREACHABLE_CODES:
            self._on_client_error(BrokerState.UNREACHABLE, text, False)
        else:
            self._on_client_error(BrokerState.ERROR, text, False)

    def send(self, row: OutboxRow, on_delivery: DeliveryCallback) -> Outcome | None:
        """Queue one row.  Returns an Outcome at once when it cannot be queued, else None."""
        try:
            headers = encode_headers(row)
        except BadRow as exc:
            return Outcome(ok=False, error_class="bad_headers", message=str(exc), permanent=True)

        def report(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                on_delivery(row, DELIVERED)
            else:
                on_delivery(row, classify(err))

        key = row.key.encode() if row.key is not None else None
        refreshed = full = False
        while True:
            try:
                self._producer.produce(row.topic, value=row.value, key=key, headers=headers,
                                       on_delivery=report)
                return None
            except BufferError:
                # The local queue is full (a broker outage, a partition without a leader):
                # serve the reports that are ready, try once more, then give the row back
                # at once.  Never wait here: leases, heartbeats and health run on this thread.
                if full:
                    return QUEUE_FULL
                full = True
                self._producer.poll(0)
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError._UNKNOWN_TOPIC and not refreshed:
                    # The client caches "unknown": ask the cluster again once, so a topic
                    # created since (and a requeued row) goes through.
                    refreshed = True
                    self._refresh_metadata(row.topic)
                    continue
                return refused_at_produce(exc.args[0])

    def partition_of(self, row: OutboxRow) -> int | None:
        """The partition the producer sends a keyed ``row`` to; None when it cannot be
        known (no key, another partitioner, the topic's partition count unknown)."""
        if row.key is None or not self._murmur2:
            return None
        count, until = self._partitions.get(row.topic, (None, 0.0))
        if self._clock() >= until:
            count = self._look_up(row.topic, PARTITIONS_TIMEOUT_S, failure_trusted_s=PARTITIONS_UNKNOWN_S)
        return default_partition(row.key.encode(), count) if count else None

    def partitions_now(self, topic: str, *, timeout_s: float = PARTITIONS_TIMEOUT_S) -> int | None:
        """``topic``'s partition count as the cluster gives it now (one metadata request of
        at most ``timeout_s``); None when it cannot be known (the cluster unreachable, the
        topic gone or not authorized, the client closed).  A count found replaces
        :meth:`partition_of`'s at once.

        For a thread other than the pump's (the partition watch, relay/topic_partitions.py),
        which must never wait on a metadata request: :meth:`recreate` and :meth:`close`
        wait for a request under way (``timeout_s`` at most) before they destroy the client."""
        with self._client_lock:
            if self._closed:
                return None
            return self._look_up(topic, timeout_s, failure_trusted_s=None)

    def _look_up(self, topic: str, timeout_s: float, *, failure_trusted_s: float | None) -> int | None:
        """``topic``'s partition count from one metadata request (at most ``timeout_s``; None
        when it fails), remembered for :meth:`partition_of`: a count for PARTITIONS_TTL_S, a
        failure for ``failure_trusted_s`` (None: not remembered; the count remembered stays).
        Either from its answer.  On the pump's thread, or holding the client lock (__init__)."""
        count = self._partition_count(topic, timeout_s)
        # One store of a tuple each: partition_of, on the pump's thread, reads it without a lock.
        if count is not None:
            self._partitions[topic] = (count, self._clock() + PARTITIONS_TTL_S)
        elif failure_trusted_s is not None:
            self._partitions[topic] = (None, self._clock() + failure_trusted_s)
        return count

    def _partition_count(self, topic: str, timeout_s: float) -> int | None:
        """One metadata request for ``topic`` (at most ``timeout_s``); None when it fails."""
        try:
            metadata = self._producer.list_topics(topic=topic, timeout=timeout_s)
        except KafkaException:
            return None
        found = metadata.topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            return None
        return len(found.partitions)

    def _refresh_metadata(self, topic: str) -> None:
        try:
            self._producer.list_topics(topic=topic, timeout=2.0)
        except KafkaException:
            pass  # still unknown or unreachable: the produce below reports it

    def send_dead_letter(self, row: OutboxRow, *, topic: str, reason: str, error: str,
                         attempts: int, timeout_s: float = 2.0) -> str | None:
        """Produce a dead-lettered row to ``topic`` and wait for the acknowledgement.

        The original value goes along unless it is the problem (too large); the original
        headers travel as one JSON header, since they may be what could not be encoded
        (unless the claim left them out with the key, for a row over the producer's limit).
        Returns None on success, else the error.
        """
        headers: list[tuple[str, str | bytes | None]] = [
            ("event_id", row.event_id.encode()), ("dlt_reason", reason.encode()),
            ("dlt_error", error[:1000].encode()), ("dlt_topic", row.topic.encode()),
            ("dlt_attempts", str(attempts).encode()),
        ]
        if row.headers_json is not None:  # None: too large to carry (the claim left them out)
            headers.append(("dlt_original_headers", (row.headers_json or "{}").encode()))
        value = None if reason == "message_too_large" else row.value
        problem = self._produce_dead_letter(row, topic, value, headers, timeout_s)
        if problem is _TOO_LARGE and value is not None:
            # The row's value was within the limit and the letter, with its headers, is not:
            # sent without it (the row keeps it in outbox_dead_letters).  Failing instead held
            # the row and every later row of its key for ever, retried every second.
            headers.append(("dlt_value_dropped", b"the dead letter with the value was over message.max.bytes"))
            problem = self._produce_dead_letter(row, topic, None, headers, timeout_s)
        if problem is _TOO_LARGE:
            return f"dead-letter topic {topic}: the dead letter is over message.max.bytes"
        return None if problem is None else f"dead-letter topic {topic}: {problem}"

    def _produce_dead_letter(self, row: OutboxRow, topic: str, value: bytes | None,
                             headers: list[tuple[str, str | bytes | None]], timeout_s: float) -> str | None:
        """One dead letter produced and waited for: None, the error, or ``_TOO_LARGE``."""
        done: list[KafkaError | None] = []
        try:
            self._producer.produce(topic, value=value, headers=headers,
                                   key=row.key.encode() if row.key is not None else None,
                                   on_delivery=lambda err, msg: done.append(err))
        except KafkaException as exc:
            return _TOO_LARGE if exc.args[0].code() in _SIZE_CODES else str(exc)
        except BufferError as exc:
            return str(exc) or "the client's queue is full"
        deadline = time.monotonic() + timeout_s
        while not done and time.monotonic() < deadline:
            self._producer.poll(0.05)
        if not done:
            return f"no acknowledgement within {timeout_s} s"
        if done[0] is None:
            return None
        return _TOO_LARGE if done[0].code() in _SIZE_CODES else str(done[0].str())

    def poll(self, timeout_s: float) -> int:
        """Serve delivery reports and client errors; returns the number served.  Waits at
        least a whole millisecond for any positive ``timeout_s`` (:func:`poll_timeout`)."""
        return int(self._producer.poll(poll_timeout(timeout_s)))

    def wait_reports(self, timeout_s: float) -> int:
        """Serve delivery reports until none is outstanding, or for ``timeout_s`` (rounded
        like :meth:`poll`'s); returns how many are still outstanding.

        One call into the client, where :meth:`poll` returns at each response: a paced
        batch's rows go out in one request per partition (librdkafka sends one partition
        per ProduceRequest), so waiting for them by ``poll`` took a call per response."""
        return int(self._producer.flush(poll_timeout(timeout_s)))

    def in_flight(self) -> int:
        return len(self._producer)

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every report; returns how many are still outstanding."""
        return int(self._producer.flush(timeout_s))

    def warm_up(self, timeout_s: float = WARM_UP_TIMEOUT_S, *,
                stopping: Callable[[], bool] = lambda: False) -> bool:
        """Have the client connected to the cluster, its producer id asked for, before the
        relay takes a lease (:func:`await_cluster`).

        An idempotent librdkafka client asks for its producer id when a metadata answer
        comes from a broker that is up, and otherwise on a 500 ms timer started when the
        client is made.  On tansu the answers to the client's own requests never did, and
        the relay's first rows went 0.7-1 s after its first lease, every time a relay
        started, restarted or joined (issue 18's twenty-fourth pass); on Apache Kafka the
        connection's set-up came after the leases, the shards taken over idle meanwhile.
        Every metadata answer from a connected broker runs librdkafka's producer-id state
        machine, so the id is asked for a round trip before this returns."""
        self._answered = await_cluster(self._producer, timeout_s, stopping=stopping) or self._answered
        return self._answered

    def recreate(self) -> None:
        """Replace a producer that hit a fatal (idempotence) error; unacked rows stay pending.

        The old client's unacknowledged messages are purged and their reports served here,
        on the pump's thread, before it goes (as failures: their rows are sent again); then
        it is closed, its threads joined.  It was purged, flush(0)ed and dropped: flush(0)
        serves only the reports queued at that instant, the purged in-flight messages' came
        a moment later to a client destroyed by then, and their batch never settled (50 of
        50 rows in flight, tests/integration/test_publisher_recreate.py)."""
        with self._client_lock:  # a partition watch's request on the old client ends first
            destroy_producer(self._producer)
            self._producer = self._new_producer()

    def close(self, timeout_s: float = 0.0) -> int:
        """Wait up to ``timeout_s`` for the outstanding reports, give up on the rest (purged:
        their reports come now, as failures, and their rows stay pending, to be published
        again), then destroy the client, its threads joined.  Returns how many were given
        up.  Idempotent; nothing may be sent afterwards.

        The client is destroyed here, not by the garbage collector (its error callback
        holds this object, a cycle) or at interpreter exit, where librdkafka's threads still
        ran while the process tore down: a relay stopping on an untrusted certificate with
        rows queued died of SIGSEGV instead of exiting 1."""
        if self._closed:
            return 0
        self._closed = True
        with self._client_lock:  # a partition watch's request ends first; none starts after
            left = destroy_producer(self._producer, timeout_s)  # the purged messages' reports served
            self._producer = _CLOSED
        return left
