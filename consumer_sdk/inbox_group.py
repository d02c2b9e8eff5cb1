"""The Kafka part of :class:`~consumer_sdk.inbox.InboxConsumer`: joining the group (or
assigning), rebalances, the client's errors, the messages a poll returns, and the
keep-alive wait that keeps the membership during back-offs.

Rebalances, eager (``range``, ``roundrobin``) or incremental (``cooperative-sticky``, and
``group.protocol=consumer``): confluent-kafka calls ``on_assign``/``on_revoke``/``on_lost``
from inside ``poll``/``consume`` with the partitions that change (the whole assignment
when eager, the increment when cooperative; an assign callback comes at every rebalance,
perhaps empty), and once the callback returns it assigns or unassigns them itself
(``incremental_*`` when cooperative).  So the callbacks only keep the books: a revoked
partition's applied offsets are committed, then it is forgotten, and the batch in hand
is interrupted only when it holds records of a partition taken away.
"""

from __future__ import annotations

from confluent_kafka import OFFSET_STORED, Consumer, KafkaError, Message, TopicPartition

from consumer_sdk import kafka
from consumer_sdk.inbox_offsets import InboxOffsets
from consumer_sdk.model import KafkaRecord
from consumer_sdk.offsets import TopicPart
from outbox_core.kafka_errors import setup_failure
from outbox_core.secrets import scrub

_KEEPALIVE_POLL_S = 0.2


class Abandon(Exception):
    """The rest of the batch is left unsettled (a rebalance moved partitions, or stop())."""


class InboxGroup(InboxOffsets):
    """Group membership, rebalances, client errors and the keep-alive wait."""

    #: Partitions revoked or lost since the batch in hand was polled (``_poll`` empties it).
    _moved: set[TopicPart]

    def _join(self, consumer: Consumer) -> None:
        """Subscribe (join the group), or assign every partition of the topics."""
        if self.config.assignment == "subscribe":
            consumer.subscribe(list(self.config.topics), on_assign=self._on_assign,
                               on_revoke=self._on_revoke, on_lost=self._on_lost)
        else:
            parts = [TopicPartition(t, p, OFFSET_STORED) for t in self.config.topics
                     for p in kafka.wait_partitions(consumer, t, stop=self._stop, log=self.log,
                                                    refused=self._refused, fatal=lambda: self._fatal)]
            self._answered = bool(parts)
            consumer.assign(parts)
            self.assigned = {(tp.topic, tp.partition) for tp in parts}

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._answered = True
        self.metrics.rebalances.labels(self.config.name, "assign").inc()
        self.assigned |= {(tp.topic, tp.partition) for tp in partitions}
        self.log.info("partitions_assigned", partitions=kafka.names(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Commit what was applied on the revoked partitions, then forget them."""
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        self._commit_pending(consumer, revoked)
        self._forget(revoked, "revoke")
        # librdkafka keeps a partition's pause flag across revoke and re-assign: a
        # partition revoked during a back-off would come back paused and silent.
        consumer.resume(partitions)
        self.log.info("partitions_revoked", partitions=kafka.names(partitions))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._forget({(tp.topic, tp.partition) for tp in partitions}, "lost")
        consumer.resume(partitions)  # as in _on_revoke: never come back paused
        self.log.warning("partitions_lost", partitions=kafka.names(partitions))

    def _forget(self, parts: set[TopicPart], kind: str) -> None:
        # A stale applied offset must never be committed later over the next owner's progress.
        self._moved |= parts
        self.metrics.rebalances.labels(self.config.name, kind).inc()
        self.offsets.forget(parts)
        self.parked.forget(parts)
        self.metrics.dead_letter_blocked.labels(self.config.name).set(len(self.parked))
        for key in parts:
            try:
                self.metrics.lag.remove(self.config.name, key[0], str(key[1]))
            except KeyError:
                pass
        self._stash = [r for r in self._stash if (r.topic, r.partition) not in parts]
        self.assigned -= parts

    def _batch_moved(self) -> bool:
        """True when a partition of the batch's unsettled records was revoked or lost since
        it was polled: its records must not be applied now (the next owner starts at the
        offset committed in :meth:`_on_revoke`), so the batch is interrupted.  An assignment,
        or a revoke of partitions the batch has no record of (every member gets one or the
        other at each cooperative rebalance), leaves the batch running."""
        moved = self._moved
        return bool(moved) and any((r.topic, r.partition) in moved for r in self._unsettled)

    def _owned(self, records: list[KafkaRecord]) -> list[KafkaRecord]:
        """``records`` without those of partitions this member does not own (any more).

        One ``consume()`` call may run a revoke callback and still return the messages it
        had gathered before it, of the revoked partitions (librdkafka purges them only if
        the partitions' version barrier reaches the queue before the call returns).  Applied,
        they would run beside the next owner, which starts at the offset committed at the
        revoke, and their offsets would be committed over its progress.  Dropping them
        loses nothing: the committed offset is never past an unapplied record."""
        owned = [r for r in records if (r.topic, r.partition) in self.assigned]
        if len(owned) < len(records):
            gone = sorted({f"{r.topic}[{r.partition}]" for r in records if (r.topic, r.partition) not in self.assigned})
            self.log.info("revoked_records_dropped", records=len(records) - len(owned), partitions=gone)
        return owned

    def _accept(self, msg: Message) -> KafkaRecord | None:
        err = msg.error()
        if err is None:
            self._answered = True
            return kafka.record_of(msg)
        refused = self._refused(err.code(), msg.topic(), err.str())
        if err.fatal() or refused is not None:
            self._fatal = refused or self._kafka_text(err)
        elif err.code() == KafkaError._MAX_POLL_EXCEEDED:
            self.log.warning("kafka_consume_error", error=self._kafka_text(err), topic=msg.topic(),
                             partition=msg.partition(), hint=self._max_poll_hint())
        elif err.code() != KafkaError._PARTITION_EOF:
            self.log.warning("kafka_consume_error", error=self._kafka_text(err), topic=msg.topic(),
                             partition=msg.partition())
        return None

    def _max_poll_hint(self) -> str:
        """What to do when librdkafka left the group for want of a poll (librdkafka's own
        line names neither the cause nor a setting of the SDK's)."""
        c = self.config
        cause = (f"a batch (batch_size={c.batch_size}) is one transaction: lower batch_size, make the handler "
                 "faster" if c.batch_size > 1 else "one handler call ran that long: make it faster")
        return (f"this member did not poll Kafka for max.poll.interval.ms ({c.max_poll_interval_s() * 1000:.0f} ms) "
                "and left its group: its partitions went to another member and the offsets it applied could "
                "not be committed (the inbox drops what comes again).  It polls between transactions, not "
                f"inside one; {cause}, or raise max.poll.interval.ms in kafka_properties")


    def _client_error(self, err: KafkaError) -> None:
        text = self._kafka_text(err)
        # librdkafka retries a rejected password, or a TLS set-up that cannot work, for ever.
        failure = (setup_failure(err.code(), text, answered=self._answered)
                   or self._tls_probe.failure(err.code(), text, answered=self._answered))
        if failure is not None or err.fatal():
            if self._fatal is None:  # once: librdkafka repeats it at each try
                self._fatal = failure or text
                self.log.error("kafka_fatal", error=self._fatal)
        elif err.code() != self._last_client_error:
            self.log.warning("kafka_client_error", error=self._kafka_text(err))
        self._last_client_error = err.code()

    def _refused(self, code: int, topic: str | None, text: str) -> str | None:
        """The line naming the ACL this consumer lacks on its own group or topics, or None."""
        props = self.config.kafka_properties
        return kafka.access_refused(code, topic, group=self.config.group, topics=self.config.topics,
                                    properties=props, text=scrub(text, properties=props))

    def _kafka_text(self, err: KafkaError) -> str:
        """librdkafka's text, which may quote a secret property's value (a malformed
        sasl.oauthbearer.config, from where its parsing stopped), masked."""
        return scrub(err.str(), properties=self.config.kafka_properties)

    def _membership_due(self) -> bool:
        """True once half of ``max.poll.interval.ms`` went by since the last poll."""
        return self._clock() - self._polled_at >= self._membership_s

    def _keep_membership(self) -> None:
        """Poll once (:meth:`_keepalive_sleep`, 0 s) between two transactions of a batch, when
        :meth:`_membership_due` (the processor's ``between``, after the COMMITs before it were
        confirmed).  Without it a poll's messages applied for longer than
        ``max.poll.interval.ms`` (slow handlers, ``prefetch_records`` of them) made librdkafka
        leave the group: their offsets could not be committed, the partitions went to another
        member, which applied the same partitions' next events while this one still applied
        its own, and the group rebalanced at every such poll.

        Raises :class:`Abandon` when a rebalance took a partition of the batch away (or
        :meth:`stop`): the rest of the batch is left unsettled, as in a back-off."""
        self._keepalive_sleep(0.0)

    def _keepalive_sleep(self, duration_s: float) -> None:
        """Wait with the partitions paused, polling (at least once) so the group keeps this member.

        Raises :class:`Abandon` on :meth:`stop`, or when a partition of the batch's unsettled
        records was revoked or lost meanwhile (:meth:`_batch_moved`).
        """
        if self._deferred:  # what was applied before the back-off is not held back by it
            self._commit_deferred()
        consumer = self._live()
        paused = consumer.assignment()
        if paused:
            consumer.pause(paused)
        try:
            deadline = self._clock() + duration_s
            left = duration_s
            while True:
                if self.stopping:
                    raise Abandon()
                msg = consumer.poll(max(min(left, _KEEPALIVE_POLL_S), 0.0))
                self._polled_at = self._clock()
                if msg is not None:
                    record = self._accept(msg)
                    if record is not None:  # fetched before the pause took effect: keep it for later
                        self._stash.extend(self._owned([record]))
                if self.stopping or self._batch_moved():
                    raise Abandon()
                if (left := deadline - self._clock()) <= 0:
                    break
        finally:
            current = [tp for tp in consumer.assignment() if (tp.topic, tp.partition) not in self.parked]
            if current:
                consumer.resume(current)
