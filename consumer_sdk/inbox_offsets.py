"""The offsets part of :class:`~consumer_sdk.inbox.InboxConsumer`: each settled message's
offset is committed after its database commit (at once, or at the poll's end one message
at a time), never past a message that is not settled; abandoned records are fetched again.
"""

from __future__ import annotations

from collections.abc import Sequence

from confluent_kafka import Consumer, KafkaError

from consumer_sdk import kafka
from consumer_sdk.inbox_state import InboxState
from consumer_sdk.model import KafkaRecord
from consumer_sdk.offsets import TopicPart

#: The commit errors that say only that the group moved on while the commit was under way: a
#: rebalance in progress, this member's generation (ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID) or,
#: with ``group.protocol=consumer`` (KIP-848), its epoch (STALE_, FENCED_MEMBER_EPOCH) gone.
#: Expected during a cooperative rebalance, and nothing is lost: each partition's new owner
#: commits its own offsets, and what it receives again is dropped by the inbox (event_id).
_GROUP_MOVED_ON = frozenset({
    KafkaError.ILLEGAL_GENERATION, KafkaError.REBALANCE_IN_PROGRESS, KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError.STALE_MEMBER_EPOCH, KafkaError.FENCED_MEMBER_EPOCH})


def group_moved_on(errors: Sequence[kafka.CommitError]) -> bool:
    """True when every commit error (``commit_offsets``'s, by its code) says only that the group
    rebalanced under the commit (:data:`_GROUP_MOVED_ON`): logged as info, not as a warning.
    Any other error (the coordinator unreachable, an authorization, a timeout) is a warning."""
    return bool(errors) and all(error.code in _GROUP_MOVED_ON for error in errors)


class InboxOffsets(InboxState):
    """Commits the offsets of what was settled, and rewinds what was abandoned."""

    def _settled(self, records: Sequence[KafkaRecord]) -> None:
        """Called by the processor after each database commit: commit the offsets now, or,
        one-at-a-time, once the poll's last message is applied (see ``prefetch_records``).

        Records of a partition revoked or lost since the poll (the keeper served the
        rebalance while their transaction ran: :mod:`consumer_sdk.inbox_keeper`) settle no
        offset: the partition was forgotten, and its position now is the next owner's (their
        effect is once all the same: the inbox)."""
        del self._unsettled[: len(records)]
        with self._keeper.held():
            if moved := self._moved:
                records = [r for r in records if (r.topic, r.partition) not in moved]
                if not records:
                    return
            if self.config.poll_records == self.config.batch_size:
                self._commit_settled(records)
            else:
                self._deferred |= self.offsets.settle(records)

    def _commit_deferred(self) -> None:
        parts, self._deferred = self._deferred, set()
        consumer = self._live()
        self._commit_pending(consumer, None)
        self._update_lag(consumer, parts & self.assigned)

    def _commit_settled(self, records: Sequence[KafkaRecord]) -> None:
        parts = self.offsets.settle(records)
        consumer = self._live()
        self._commit_pending(consumer, None)
        self._update_lag(consumer, parts)

    def _rewind(self, abandoned: Sequence[KafkaRecord]) -> None:
        """Seek each partition this member keeps back to its first abandoned record.

        An incremental rebalance (``group.protocol=consumer``, KIP-848) revokes only some
        partitions: the kept ones are not reset to their committed offsets, and their
        fetch positions are already past the abandoned records, which a later commit
        would skip.  Records of those partitions fetched meanwhile are dropped (they
        come again after the seek)."""
        first: dict[TopicPart, int] = {}
        for record in abandoned:
            key = (record.topic, record.partition)
            if key in self.assigned and key not in self.parked:
                first[key] = min(first.get(key, record.offset), record.offset)
        if not first:
            return
        self._stash = [r for r in self._stash if (r.topic, r.partition) not in first]
        consumer = self._live()
        for key, offset in first.items():
            kafka.seek(consumer, key, offset, log=self.log)
        self.log.info("partitions_rewound", positions={f"{t}[{p}]": o for (t, p), o in first.items()})

    def _commit_pending(self, consumer: Consumer, only: set[TopicPart] | None) -> None:
        due = self.offsets.due(only)
        if not due:
            return
        done, errors = kafka.commit_offsets(consumer, due)
        for key, offset in done.items():
            self.offsets.confirm(key, offset)
        if not errors:
            return
        self.metrics.offset_commit_failures.labels(self.config.name).inc()
        texts = [error.text for error in errors]  # the log says them as librdkafka does
        if group_moved_on(errors):  # expected in a (cooperative) rebalance
            self.log.info("offset_commit_failed", errors=texts,
                          detail="the group rebalanced under the commit: each partition's new owner "
                                 "commits its offsets; nothing is lost (the inbox drops what comes again)")
        else:  # harmless for the effects too (the inbox drops what comes again), but not expected
            self.log.warning("offset_commit_failed", errors=texts)

    def _update_lag(self, consumer: Consumer, parts: set[TopicPart]) -> None:
        for key in parts:
            high = kafka.high_watermark(consumer, key)
            if high is not None:
                lag = self.offsets.lag(key, high)
                self.metrics.lag.labels(self.config.name, key[0], str(key[1])).set(lag)
