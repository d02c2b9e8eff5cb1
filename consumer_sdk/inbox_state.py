"""The state an :class:`~consumer_sdk.inbox.InboxConsumer`'s parts share.

The consumer is one object built from parts by responsibility, each a module of its own:
the batch loop and lifecycle (:mod:`consumer_sdk.inbox`), the offsets that follow the
database commits (:mod:`consumer_sdk.inbox_offsets`), the Kafka consumer with its
rebalances and keep-alive (:mod:`consumer_sdk.inbox_group`), the partitions parked behind a
dead letter that could not be produced (:mod:`consumer_sdk.inbox_parked`), and the waits
for the database with the inbox's retention (:mod:`consumer_sdk.inbox_upkeep`).  The
attributes they share are declared here once; ``InboxConsumer.__init__`` sets them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer

from consumer_sdk.config import InboxConfig
from consumer_sdk.inbox_keeper import KafkaKeeper
from consumer_sdk.metrics import ConsumerMetrics
from consumer_sdk.model import KafkaRecord
from consumer_sdk.offsets import OffsetBook, TopicPart
from consumer_sdk.parking import ParkingLot
from consumer_sdk.processor import Processor
from consumer_sdk.retention import RetentionFinding
from consumer_sdk.store import PgInboxStore
from outbox_core.kafka_errors import TlsListenerProbe


class InboxState:
    """What every part of the consumer reads or changes (see the module docstring)."""

    config: InboxConfig
    metrics: ConsumerMetrics
    log: Any
    store: PgInboxStore
    offsets: OffsetBook
    parked: ParkingLot
    assigned: set[TopicPart]
    retention: list[RetentionFinding]
    _clock: Callable[[], float]
    _stop: threading.Event
    _consumer: Consumer | None
    _processor: Processor | None
    _unsettled: list[KafkaRecord]
    _deferred: set[TopicPart]  # settled partitions whose offsets wait for the poll's end
    _stash: list[KafkaRecord]  # messages a keep-alive poll returned, processed next
    _fatal: str | None
    _answered: bool  # a broker answered (an assignment, a record): transport errors may pass
    _tls_probe: TlsListenerProbe
    _last_client_error: int | None
    _next_cleanup: float
    _polled_at: float  # when the Kafka consumer was last polled (the clock's seconds)
    _membership_s: float  # half of max.poll.interval.ms: a batch polls between transactions after so long
    _busy_since: float | None  # when the batch in the works began (None: none is, or it backs off)
    _moved: set[TopicPart]  # revoked or lost since the batch in hand was polled
    _keeper: KafkaKeeper  # polls Kafka beside a long transaction; the loop holds the consumer through it

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _live(self) -> Consumer:
        if self._consumer is None:
            raise RuntimeError("the consumer is not started (or already closed)")
        return self._consumer
