"""Which partitions have no leader: what the stall tracker asks in exactly-once mode.

A shard transaction with a row for a partition without a leader holds its other rows too,
and not only their outcomes: librdkafka adds a transaction's partitions to it together, so
the rows of healthy partitions added with the leaderless one stay queued, never sent (their
delivery reports, at the abort: "Purged in queue"; measured on three Apache Kafka brokers).
Their partitions look stalled by every sign the relay has of its own.  The cluster's
metadata tells them apart: relay.stalls names, of the partitions whose rows wait, those
the metadata says have no leader, when it says so of any.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from relay.exactly_once_position import shared_config

LEADERS_TTL_S = 5.0  # a topic's leaders, once asked (only while its rows look stalled), are trusted this long
#: An answer naming no partition without a leader is trusted less long: a dead broker stays
#: its partitions' leader until the controller fences it (relay.stalls.UNATTRIBUTED_AFTER_S).
LEADERS_CLEAR_TTL_S = 2.0
LEADERS_TIMEOUT_S = 1.0  # the metadata request, on the pump's thread


class Leaders:
    """The partitions without a leader, per topic, from a metadata-only client made when
    first asked (a stall), each topic asked at most every ``LEADERS_TTL_S``."""

    def __init__(self, config: dict[str, str], clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._client: Any = None
        self._known: dict[str, tuple[float, frozenset[int] | None]] = {}  # topic -> (until, leaderless)
        self._silent_until = float("-inf")  # no metadata answered: ask no topic before then

    def leaderless(self, topic: str) -> frozenset[int] | None:
        """The partitions of ``topic`` whose leader is unknown to the cluster (None: no answer).
        A request that got no answer (every broker out of reach) holds every topic's for
        ``LEADERS_TTL_S``: the pump's thread, which runs the lease heartbeats too, waits at
        most ``LEADERS_TIMEOUT_S`` each time, however many topics have rows waiting."""
        now = self._clock()
        until, known = self._known.get(topic, (float("-inf"), None))
        if now < until:
            return known
        if now < self._silent_until:
            return None
        try:
            if self._client is None:
                self._client = AdminClient(shared_config(self._config))
            metadata = self._client.list_topics(topic=topic, timeout=LEADERS_TIMEOUT_S).topics.get(topic)
            known = None if metadata is None else frozenset(
                p for p, partition in metadata.partitions.items() if partition.leader < 0)
        except KafkaException:
            known, self._silent_until = None, now + LEADERS_TTL_S
        self._known[topic] = (now + (LEADERS_CLEAR_TTL_S if known == frozenset() else LEADERS_TTL_S), known)
        return known
