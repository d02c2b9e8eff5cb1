"""Says when a topic the relay publishes to changes its partition count.

Kafka's default partitioner sends a key to ``murmur2(key) % partitions``: partitions added to
a topic move most keys to another partition.  A key's later events then go to the new one
while its earlier ones may still be unread in the old one, and a consumer can see them out
of order.  Kafka warns nobody and the relay cannot prevent it; but it is the first process
to see it, and an SRE looking for why events came out of order needs to find it:
``topic_partitions_changed`` (a warning, with the counts and what it means) and
``outbox_relay_topic_partition_changes_total{topic}``.

:class:`PartitionWatch` looks every ``every_s`` (60 s) at the topics published to since its
last round: those of ``outbox_relay_events_published_total`` whose count rose, so at most
``--metrics-max-topics`` topics (relay/metric_labels.py: a writer minting a topic per row
adds none).  Each is one metadata request of the relay's producer
(:meth:`relay.publisher.Publisher.partitions_now`, 1 s at most).  Its answer is the
producer's too: librdkafka partitions by the new count from then on (else from its own
refresh, ``topic.metadata.refresh.interval.ms``, 5 minutes), and so does the pump's
``partition_of``: this relay's keys moved at the line, or at most a round before it
(tests/integration/kafka/test_topic_partitions_added.py); each replica says it.  In
exactly-once mode the shard producers are clients of their own: they move keys at their
own refresh, up to 5 minutes after the line.  A round stops asking after
``budget_s`` (an unreachable cluster costs 5 requests a round; the topics left go first
next round).  A lookup that fails is no change, and the first count seen of a topic is
none either: so a topic first published to is looked up within :data:`FIRST_LOOK_S` (a
second), not at the next round.  Until then the first look came up to a minute after the
relay first sent to the topic, and partitions added in that minute were taken for the
first count, unsaid (a relay restarted beside a topic's change).

On a thread of its own (``outbox-relay-partitions``), never the pump's: a metadata request
waits on the network, and the pump never does (relay/publisher.py ``send``).  The relay's
other threads do not fit: the cleanup thread (relay/janitor.py) runs only with retention or
a partitioned outbox, and its rounds (50 delete batches, a database outage waited out) can
take minutes; the wait watch (relay/waits.py) must look within seconds while the relay is
held up, which is when /healthz reads it; the backlog gauges run on the loop's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from relay.metric_labels import OTHER_TOPICS
from relay.metrics import RelayMetrics

CHECK_EVERY_S = 60.0  # how often the topics published to are looked at
LOOKUP_TIMEOUT_S = 1.0  # one topic's metadata request
ROUND_BUDGET_S = 5.0  # a round asks no more once it has taken this long
FIRST_LOOK_S = 1.0  # a topic first published to is looked up within this long

#: What a person can do about it, in the log line.
MOVED_HINT = ("keys moved between partitions: per-key order holds only within each partition from now "
              "on, and consumers may see a key's later events before its earlier ones still unread in "
              "the old partition. Drain the topic's consumers before adding partitions, or accept it")
FEWER_HINT = ("Kafka cannot take partitions away: the topic was probably deleted and created again, "
              "its earlier events gone with it; " + MOVED_HINT)


@dataclass(frozen=True)
class PartitionChange:
    topic: str
    before: int
    after: int


class PartitionCounts:
    """The partition count last seen of each topic; pure (no I/O, no clock)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def saw(self, topic: str, count: int | None) -> PartitionChange | None:
        """The change ``count`` is for ``topic``: None for a failed lookup (``count`` None:
        nothing learnt), a first sighting, or the count seen before."""
        if count is None:
            return None
        before = self.seen.get(topic)
        self.seen[topic] = count
        if before is None or before == count:
            return None
        return PartitionChange(topic, before, count)


def published_by_topic(metrics: RelayMetrics) -> dict[str, float]:
    """Rows counted published, by topic, of the topics with a label of their own (at most
    ``--metrics-max-topics``; those under ``_other`` have no name here).  Read through the
    counter's ``collect``, which takes its lock: safe beside the pump thread's increments."""
    return {sample.labels["topic"]: sample.value
            for family in metrics.published.collect() for sample in family.samples
            if sample.name.endswith("_total") and sample.labels.get("topic") != OTHER_TOPICS}


@dataclass(slots=True)
class _Looks:
    """What the watch remembers of one topic published to."""

    rows: float = 0.0  # rows published when its count was last found (more since: it is due)
    asked_at: float = float("-inf")  # when it was last asked (the clock's; the oldest go first)


class PartitionWatch:
    """The watch; see the module's docstring.  ``start()``, idempotent ``stop()``,
    ``run_once()`` (one round; tests call it)."""

    def __init__(self, *, partitions: Callable[[str], int | None],
                 published: Callable[[], Mapping[str, float]], metrics: RelayMetrics, log: Any,
                 every_s: float = CHECK_EVERY_S, budget_s: float = ROUND_BUDGET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``partitions``: a topic's count now (None: unknown); ``published``: rows published
        so far by topic, of the topics to watch."""
        self._partitions = partitions
        self._published = published
        self.metrics = metrics
        self.log = log
        self.every_s = every_s
        self.budget_s = budget_s
        self._clock = clock
        self.counts = PartitionCounts()
        self._looks: dict[str, _Looks] = {}  # by topic, once asked
        self.rounds = 0  # rounds done: tests wait on it
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, *, first_looks: bool = False) -> list[PartitionChange]:
        """Look up the topics published to since they were last looked up; say each change.
        ``first_looks``: only those never looked up yet (between rounds; see the module)."""
        published = self._published()
        never = _Looks()  # a topic not asked yet (not stored)
        due = sorted((topic for topic, rows in published.items()
                      if rows > self._looks.get(topic, never).rows and not (first_looks and topic in self._looks)),
                     key=lambda topic: self._looks.get(topic, never).asked_at)
        started = self._clock()
        changes: list[PartitionChange] = []
        for topic in due:
            if self._stopping.is_set() or self._clock() - started >= self.budget_s:
                break  # the topics left are still due: asked first next round
            looks = self._looks.setdefault(topic, _Looks())
            looks.asked_at = self._clock()
            count = self._partitions(topic)
            if count is None:
                continue  # unknown is no change; looked up again next round
            looks.rows = published[topic]
            change = self.counts.saw(topic, count)
            if change is not None:
                self._say(change)
                changes.append(change)
        if not first_looks:
            self.rounds += 1
        return changes

    def _say(self, change: PartitionChange) -> None:
        # The topic has a label of its own (published_by_topic): it is its label.
        self.metrics.topic_partition_changes.labels(change.topic).inc()
        self.log.warning("topic_partitions_changed", topic=change.topic, partitions_before=change.before,
                         partitions_after=change.after,
                         hint=MOVED_HINT if change.after > change.before else FEWER_HINT)

    def start(self) -> None:
        """A round every ``every_s`` on a thread of its own until :meth:`stop`.  Idempotent;
        a stopped watch does not start again."""
        if self._thread is None and not self._stopping.is_set():
            self._thread = threading.Thread(target=self._run, name="outbox-relay-partitions", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after the lookup under way, waiting for it up to ``timeout_s`` (0: only ask;
        safe in a signal handler).  Idempotent."""
        self._stopping.set()
        thread = self._thread
        if thread is not None and timeout_s > 0 and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        """A round every ``every_s``; between them, every :data:`FIRST_LOOK_S`, the first look
        at the topics published to since."""
        next_round = self._clock() + self.every_s
        while not self._stopping.wait(max(0.0, min(FIRST_LOOK_S, next_round - self._clock()))):
            full = self._clock() >= next_round
            if full:
                next_round = self._clock() + self.every_s
            try:
                self.run_once(first_looks=not full)
            except Exception as exc:  # noqa: BLE001 - a round's failure must not end the watch
                if full:  # a failure of every look is said once a round, not every second
                    self.log.error("partition_check_failed", error=f"{type(exc).__name__}: {exc}"[:500])
