"""Offset bookkeeping of the dedup consumer (no I/O).

Per partition, two positions: ``applied`` is the next offset after what the
database committed (or what was durably dead-lettered or skipped), ``committed``
what Kafka acknowledged.  The invariant the consumer keeps: a position is
committed to Kafka only once it is applied, so ``committed <= applied`` always.
A revoked or lost partition is forgotten, so its stale position can never be
committed later over the next owner's progress.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from consumer_sdk.model import KafkaRecord

TopicPart = tuple[str, int]


class OffsetBook:
    """Applied versus committed positions; the consumer loop's only offset state."""

    def __init__(self) -> None:
        self.applied: dict[TopicPart, int] = {}
        self.committed: dict[TopicPart, int] = {}

    def settle(self, records: Sequence[KafkaRecord]) -> set[TopicPart]:
        """Record settled messages; returns the partitions they belong to."""
        # A partition's records come in offset order: its last one is its position.
        last = {(record.topic, record.partition): record.offset for record in records}
        applied = self.applied
        for key, offset in last.items():
            applied[key] = max(applied.get(key, 0), offset + 1)
        return set(last)

    def due(self, only: set[TopicPart] | None = None) -> dict[TopicPart, int]:
        """Applied positions Kafka has not acknowledged yet (of ``only`` when given)."""
        return {key: offset for key, offset in self.applied.items()
                if self.committed.get(key) != offset and (only is None or key in only)}

    def confirm(self, key: TopicPart, offset: int) -> None:
        """Kafka acknowledged ``offset`` for ``key``."""
        self.committed[key] = offset

    def forget(self, parts: Iterable[TopicPart]) -> None:
        for key in parts:
            self.applied.pop(key, None)
            self.committed.pop(key, None)

    def lag(self, key: TopicPart, high_watermark: int) -> int:
        """Messages after the applied position, given the partition's high watermark."""
        return max(high_watermark - self.applied.get(key, 0), 0)
