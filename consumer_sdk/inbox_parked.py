"""The parked partitions of :class:`~consumer_sdk.inbox.InboxConsumer`: a dead letter
that could not be produced pauses its partition right after its record; the letter alone
is sent again with back-off, and the partition resumes once it went.
"""

from __future__ import annotations

from confluent_kafka import TopicPartition

from consumer_sdk import kafka
from consumer_sdk.errors import DeadLetterBlocked
from consumer_sdk.inbox_offsets import InboxOffsets
from consumer_sdk.model import BatchResult, DeadLetter


class InboxParked(InboxOffsets):
    """Dead letters that could not be produced."""

    def _park(self, blocked: DeadLetterBlocked) -> None:
        """Pause the letter's partition right after its record; drop what was fetched after it."""
        letter = blocked.letter
        assert isinstance(letter, DeadLetter)
        key = self.parked.park(letter, now=self._clock())
        consumer = self._live()
        self._unsettled = [r for r in self._unsettled if (r.topic, r.partition) != key]
        self._stash = [r for r in self._stash if (r.topic, r.partition) != key]
        tp = TopicPartition(key[0], key[1])
        consumer.pause([tp])
        kafka.seek(consumer, key, blocked.offset + 1, log=self.log)
        self.metrics.dead_letter_blocked.labels(self.config.name).set(len(self.parked))
        self.log.error("partition_paused", reason="dead_letter_failed", topic=key[0], partition=key[1],
                       offset=blocked.offset, error=str(blocked))

    def _retry_parked(self) -> BatchResult:
        """Send the parked letters that are due; settle and resume each one that went."""
        assert self._processor is not None
        result = BatchResult()
        for key, parked in self.parked.due(self._clock()):
            try:
                self._processor.send_dead_letter(parked.letter, result)
            except DeadLetterBlocked:
                self.parked.failed(key, now=self._clock())
                continue
            self.parked.release(key)
            result.settled += 1
            self._commit_settled([parked.letter.record])
            self._live().resume([TopicPartition(key[0], key[1])])
            self.log.info("partition_resumed", topic=key[0], partition=key[1], failures=parked.failures)
        self.metrics.dead_letter_blocked.labels(self.config.name).set(len(self.parked))
        return result
