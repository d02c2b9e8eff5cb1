"""Retention: delete published rows older than the retention, in small batches.

Each batch is its own short transaction that skips locked rows, so the relay is
never blocked, and its WHERE clause never matches an unpublished row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relay.metrics import RelayMetrics


class Janitor:
    def __init__(self, store: Any, *, retention_s: float, batch: int, interval_s: float,
                 clock: Callable[[], float], metrics: RelayMetrics | None = None,
                 max_batches: int = 50) -> None:
        self.store = store
        self.retention_s = retention_s
        self.batch = batch
        self.interval_s = interval_s
        self.clock = clock
        self.metrics = metrics
        self.max_batches = max_batches
        self._next = 0.0

    def run_if_due(self, now: float) -> int:
        if now < self._next:
            return 0
        self._next = now + self.interval_s
        return self.run_once()

    def run_once(self) -> int:
        """Delete up to ``max_batches`` batches; returns rows deleted."""
        total = 0
        for _ in range(self.max_batches):
            deleted = self.store.cleanup_batch(retention_s=self.retention_s, limit=self.batch)
            total += deleted
            if self.metrics is not None and deleted:
                self.metrics.cleanup_deleted.inc(deleted)
            if deleted < self.batch:
                break
        return total
