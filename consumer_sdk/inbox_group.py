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

from collections.abc import Callable

from confluent_kafka import OFFSET_STORED, Consumer, KafkaError, Message, TopicPartition

from consumer_sdk import kafka
from consumer_sdk.inbox_offsets import InboxOffsets
from consumer_sdk.model import KafkaRecord
from consumer_sdk.offsets import TopicPart
from outbox_core.kafka_errors import setup_failure
from outbox_core.secrets import scrub

_KEEPALIVE_POLL_S = 0.2
#: A keeper's poll: the longest the loop waits for the consumer back after a transaction.
_KEEPER_POLL_S = 0.1


class Abandon(Exception):
    """The rest of the batch is left unsettled (a rebalance moved partitions, or stop())."""


class InboxGroup(InboxOffsets):
    """Group membership, rebalances, client errors and the keep-alive wait."""

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
        line names neither the cause nor a setting of the SDK's).  The loop polls between
        transactions and its keeper beside a long one, so what remains is a process that
        did not run: stopped (SIGSTOP, a debugger), starved of CPU, a handler holding the
        GIL, or ``run_once()`` not called for that long."""
        c = self.config
        return (f"this member did not poll Kafka for max.poll.interval.ms ({c.max_poll_interval_s() * 1000:.0f} ms) "
                "and left its group: its partitions went to another member and the offsets it applied could "
                "not be committed (the inbox drops what comes again).  The consumer polls between transactions "
                "and beside a long one, so the process did not run for that long (stopped, starved of CPU, a "
                "handler holding the GIL, or run_once() not called): look there, or raise max.poll.interval.ms "
                "in kafka_properties")

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
        """True once half of ``max.poll.interval.ms`` went by since the last poll, or when a
        rebalance the keeper served during the last transaction took a partition of the batch
        (:meth:`_keep_membership` then interrupts it)."""
        return self._clock() - self._polled_at >= self._membership_s or self._batch_moved()

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
        with self._keeper.held():
            self._keepalive_wait(duration_s)

    def _keepalive_wait(self, duration_s: float) -> None:
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
                self._poll_paused(consumer, max(min(left, _KEEPALIVE_POLL_S), 0.0))
                if self.stopping or self._batch_moved():
                    raise Abandon()
                if (left := deadline - self._clock()) <= 0:
                    break
        finally:
            self._resume_assignment(consumer)

    def _keep_beside(self, hand_back: Callable[[], bool]) -> bool:
        """The keeper's session (:mod:`consumer_sdk.inbox_keeper`), on its thread while the
        loop's transaction runs: poll with the assignment paused until ``hand_back()``.

        The assignment is paused again before each poll: a partition assigned meanwhile is
        not paused (and one revoked was resumed by :meth:`_on_revoke`), and would fill the
        stash for as long as the transaction runs.  What a poll returns anyway (fetched
        before the pause) is stashed as in :meth:`_keepalive_sleep`; rebalance callbacks run
        here and keep the books (the batch stops after this transaction when one of its
        partitions moved: :meth:`_membership_due`).

        Returns True when it gave up after ``keep_membership_max_intervals`` intervals (a
        consumer setting, 3 by default): the keeper then polls no more beside this transaction
        (``membership_released``), and librdkafka leaves the group one interval later, as it
        did before the keeper (a hung handler's partitions go to other members): a slow
        transaction is kept, a hung one not for ever."""
        consumer = self._live()
        busy_since = self._busy_since

        def busy_s() -> float | None:
            return None if busy_since is None else round(self._clock() - busy_since, 1)

        self.log.info("membership_kept", idle_s=round(self._clock() - self._polled_at, 1), busy_s=busy_s(),
                      hint="a transaction runs past half of max.poll.interval.ms: the consumer polls "
                           "Kafka beside it, its partitions paused, so that this member keeps them")
        interval_s, intervals = self._membership_s * 2, self.config.keep_membership_max_intervals
        warn_at, release_at = self._clock() + interval_s, self._clock() + interval_s * intervals
        try:
            while not hand_back():
                if self._clock() >= release_at:
                    self.log.warning(
                        "membership_released", busy_s=busy_s(), partitions=kafka.names(consumer.assignment()),
                        hint=f"the transaction ran {intervals} x max.poll.interval.ms beside the keeper "
                             "(InboxConfig.keep_membership_max_intervals): it "
                             "polls no more, so this member leaves its group one interval later and its partitions "
                             "go to other members (the transaction's own wait on its inbox rows: database_lock_wait); "
                             "a handler this slow on purpose wants a larger max.poll.interval.ms")
                    return True
                if self._clock() >= warn_at:  # a hung handler holds every partition of this member
                    warn_at += interval_s
                    self.log.warning("transaction_running_long", busy_s=busy_s(),
                                     partitions=kafka.names(consumer.assignment()),
                                     hint="this member keeps its partitions while the transaction runs, and "
                                          "none of them progresses meanwhile: a hung handler stalls them all")
                assignment = consumer.assignment()
                if assignment:
                    consumer.pause(assignment)
                self._poll_paused(consumer, _KEEPER_POLL_S)
        finally:
            self._resume_assignment(consumer)
        return False

    def _poll_paused(self, consumer: Consumer, timeout_s: float) -> None:
        """One poll with the assignment paused (the keep-alive's and the keeper's): it keeps
        the membership and serves the rebalance callbacks; a message fetched before the pause
        took effect is kept for later, if its partition is still this member's."""
        msg = consumer.poll(timeout_s)
        self._polled_at = self._clock()
        if msg is not None:
            record = self._accept(msg)
            if record is not None:
                self._stash.extend(self._owned([record]))

    def _resume_assignment(self, consumer: Consumer) -> None:
        """Resume what a keep-alive paused, except the partitions parked behind a dead letter."""
        current = [tp for tp in consumer.assignment() if (tp.topic, tp.partition) not in self.parked]
        if current:
            consumer.resume(current)
