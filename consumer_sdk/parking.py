"""Partitions paused behind a dead letter that could not be produced (no I/O).

When the dead-letter topic refuses a letter (too large, missing, denied), the
record is neither applied nor dead-lettered, so its offset may not be committed;
running its handler again would repeat its external effects.  So the letter,
with the handler's error, is *parked*: the partition is paused at the record,
only the sending is retried (with back-off), and once the broker acknowledges it
the record is settled and the partition resumes after it.  Other partitions
keep flowing.  A revoked partition is forgotten: its next owner starts from the
committed offset (and runs the handler once more, the only repetition left).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from consumer_sdk.model import DeadLetter
from consumer_sdk.offsets import TopicPart


@dataclass(slots=True)
class Parked:
    """One partition's letter waiting to be sent."""

    letter: DeadLetter
    failures: int
    next_at: float  # monotonic seconds


class ParkingLot:
    """Parked letters by partition, and when each is retried next."""

    def __init__(self, *, backoff_initial_s: float, backoff_max_s: float) -> None:
        self._initial_s = backoff_initial_s
        self._max_s = backoff_max_s
        self.parked: dict[TopicPart, Parked] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.parked

    def __len__(self) -> int:
        return len(self.parked)

    def park(self, letter: DeadLetter, *, now: float) -> TopicPart:
        key = (letter.record.topic, letter.record.partition)
        self.parked[key] = Parked(letter=letter, failures=1, next_at=now + self._delay_s(1))
        return key

    def due(self, now: float) -> list[tuple[TopicPart, Parked]]:
        return [(key, p) for key, p in self.parked.items() if p.next_at <= now]

    def failed(self, key: TopicPart, *, now: float) -> None:
        parked = self.parked[key]
        parked.failures += 1
        parked.next_at = now + self._delay_s(parked.failures)

    def release(self, key: TopicPart) -> None:
        self.parked.pop(key, None)

    def forget(self, parts: Iterable[TopicPart]) -> None:
        for key in parts:
            self.parked.pop(key, None)

    def _delay_s(self, failures: int) -> float:
        return float(min(self._max_s, self._initial_s * 2 ** min(failures - 1, 30)))
