"""The pump's batches on their way: produced and waiting for delivery reports
(:class:`InFlight`), then acknowledged and being marked (:class:`PendingMark`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from relay.marker import MarkOutcome
from relay.model import OutboxRow, RowId, ShardId, Token
from relay.outcomes import DELIVERED, Outcome


@dataclass(slots=True)
class InFlight:
    """One produced batch waiting for its delivery reports."""

    tokens: dict[ShardId, Token]
    rows: list[OutboxRow] = field(default_factory=list)
    outcomes: dict[RowId, Outcome] = field(default_factory=dict)
    waiting: int = 0
    produced_at: float = 0.0  # monotonic

    failures: int = 0  # outcomes that are not a delivery

    def report(self, row: OutboxRow, outcome: Outcome) -> None:
        self.outcomes[row.id] = outcome
        self.waiting -= 1
        if outcome is not DELIVERED:
            self.failures += 1

    @property
    def done(self) -> bool:
        return self.waiting <= 0

    def shards(self) -> set[ShardId]:
        return {row.shard for row in self.rows}


@dataclass(slots=True)
class PendingMark:
    """A settled batch whose acknowledged rows are being marked."""

    batch: InFlight
    acked: list[OutboxRow]
    future: Future[MarkOutcome]
