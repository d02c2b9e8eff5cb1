"""The relay's librdkafka producer as a client: made with the relay's settings and logger
(:func:`new_producer`, a refused configuration named as the user wrote it), connected to
the cluster before the relay takes a lease (:func:`await_cluster`), and a stand-in once
closed.  What is produced, and what the delivery reports mean, is relay/publisher.py's
(and relay/outcomes.py's); the exactly-once shard producers (relay/exactly_once_shard.py)
use its logger and warm-up too.  Split from relay/publisher.py at its 400-line limit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from outbox_core.kafka_errors import refusal_text
from relay.errors import ConfigError
from relay.kafka_config import KAFKA_ALIASES

WARM_UP_TIMEOUT_S = 2.0  # Publisher.warm_up: how long a new client may take to reach the cluster
WARM_UP_STEP_S = 0.01  # ... and how often it asks at most (an answer that comes at once is no wait)

_KAFKA_LOG = logging.getLogger("outbox_relay.librdkafka")
_KAFKA_LOG.addHandler(logging.NullHandler())  # state changes are reported through error_cb
_KAFKA_LOG.propagate = False


def new_producer(config: Mapping[str, str], error_cb: Callable[[KafkaError], None]) -> Producer:
    """A producer of ``config`` reporting client errors to ``error_cb``; ConfigError when
    librdkafka refuses the configuration."""
    settings: dict[str, Any] = dict(config)
    settings["error_cb"] = error_cb
    settings["logger"] = _KAFKA_LOG  # librdkafka's own lines go through logging, not raw stderr
    settings.setdefault("log.connection.close", "false")
    try:
        return Producer(settings)
    except KafkaException as exc:
        message = named_as_given(refusal_text(exc, config), config)
        raise ConfigError(f"invalid Kafka configuration: {message}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid Kafka configuration: {_one_line(str(exc))}") from None


def _one_line(text: str) -> str:
    """librdkafka's messages may end in a newline; an error is one line."""
    return " ".join(text.split())


def named_as_given(message: str, config: Mapping[str, Any]) -> str:
    """librdkafka's error with each property named as the configuration names it:
    ``linger.ms=abc`` was refused as 'Invalid value for configuration property
    "queue.buffering.max.ms"', a name the user never wrote."""
    for canonical, alias in KAFKA_ALIASES.items():
        quoted = f'"{canonical}"'
        if quoted in message and canonical not in config and alias in config:
            message = message.replace(quoted, f'"{alias}" (librdkafka\'s {canonical})')
    return message


class _ClosedProducer:
    """Stands in for a destroyed client: any use is a bug, and says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("the relay's Kafka producer is closed")

    def __len__(self) -> int:
        return 0


_CLOSED: Any = _ClosedProducer()


def await_cluster(client: Producer, timeout_s: float = WARM_UP_TIMEOUT_S, *,
                  stopping: Callable[[], bool] = lambda: False) -> bool:
    """True once a broker ``client`` learned (not the bootstrap address) answered a
    metadata request, so that its connection is up; False after ``timeout_s`` (an
    unreachable cluster: the caller goes on as it would have, and waits in its own
    requests) or as soon as ``stopping()`` (asked between requests of at most 0.25 s).

    A librdkafka client drops its bootstrap connection once it has learned the brokers;
    until a learned broker's connection is up, a producer asking for its id (or a
    transactional one for its coordinator) finds no broker and tries again on a 500 ms
    timer."""
    deadline = time.monotonic() + timeout_s  # real time: it waits on the network
    while True:
        asked = time.monotonic()
        left = deadline - asked
        if left <= 0 or stopping():  # each list_topics serves the client's error callbacks
            return False
        try:
            metadata = client.list_topics(timeout=min(left, 0.25))
        except KafkaException:
            metadata = None  # not answered within the step, or refused at once
        if metadata is not None and metadata.orig_broker_id >= 0:
            return True
        # Ask again while time is left, at most every WARM_UP_STEP_S: a refusal or a
        # bootstrap broker's answer can come at once, and asking again at once spun a
        # core (and the bootstrap broker) for the whole timeout.
        time.sleep(max(0.0, min(WARM_UP_STEP_S - (time.monotonic() - asked),
                                deadline - time.monotonic())))
