"""Retention: delete published rows older than the retention, in small batches.

Each batch is its own short transaction that skips locked rows, so the relay is
never blocked, and its WHERE clause never matches an unpublished row.  A
partitioned outbox is kept by whole partitions instead (relay/partitions.py):
the coming days are created, past days dropped once fully published.

In the relay the janitor works in its own thread on its own connection
(:meth:`Janitor.start`, :meth:`Janitor.stop`): a long cleanup round never delays a claim.
``outbox-relay cleanup`` calls :meth:`Janitor.run_once` itself.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any

from relay.errors import DatabaseUnavailable, PermissionDenied, RelayError
from relay.metrics import RelayMetrics


class Janitor:
    def __init__(self, store: Any, *, retention_s: float | None, batch: int, interval_s: float,
                 metrics: RelayMetrics | None = None,
                 max_batches: int = 50, partitioned: bool = False, log: Any = None) -> None:
        self.partitioned = partitioned
        self.log = log
        self.store = store
        self.retention_s = retention_s
        self.batch = batch
        self.interval_s = interval_s
        self.metrics = metrics
        self.max_batches = max_batches
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> int:
        """Maintain partitions (if partitioned), then delete up to ``max_batches`` batches of
        published rows past retention (in a partitioned outbox only strays are left: rows of
        outbox_default and of days whose partition still holds pending rows); returns rows
        deleted."""
        if self.partitioned:
            try:
                report = self.store.maintain_partitions(retention_s=self.retention_s)
            except PermissionDenied as exc:
                # A least-privilege relay role may not create or drop partitions: the
                # owner runs `outbox-relay cleanup` instead (sql/roles/outbox_relay_role.sql).
                self.partitioned = False
                if self.log is not None:
                    self.log.warning("partition_maintenance_refused", error=str(exc))
                return 0
            if self.log is not None:
                self._log_partitions(report)
        if self.retention_s is None:
            return 0
        total = 0
        after: datetime | None = None
        for _ in range(self.max_batches):
            deleted, newest = self.store.cleanup_batch(retention_s=self.retention_s,
                                                       limit=self.batch, after=after)
            after = newest or after
            total += deleted
            if self.metrics is not None and deleted:
                self.metrics.cleanup_deleted.inc(deleted)
            if deleted < self.batch:
                break
        return total

    def _log_partitions(self, report: Any) -> None:
        assert self.log is not None
        if report.created or report.dropped or report.default_rows:
            self.log.info("partitions_maintained", created=report.created, dropped=report.dropped,
                          kept_pending=report.kept_pending, lock_missed=report.lock_missed,
                          blocked_by_default=report.blocked_by_default,
                          default_rows=report.default_rows, detached=sorted(report.detached))
        for table, pending in report.detached_pending.items():
            # Each round: its rows left the outbox with it and are never published.
            self.log.warning("partition_detached_with_pending_rows", table=table,
                             pending_rows="not counted (locked)" if pending is None else pending,
                             hint="its unpublished rows are no longer in the outbox and will never "
                                  "be published: attach it again (ALTER TABLE outbox ATTACH "
                                  "PARTITION ...) or copy its pending rows into the outbox")
        for table in report.unreadable:
            # Each round too; maintenance of the attached partitions goes on.
            self.log.warning("partition_detached_unreadable", table=table, missing_privilege="SELECT",
                             hint=f"{table} is detached from the outbox and this role has no SELECT "
                                  "privilege on it: its unpublished rows, if any, are not counted (and "
                                  "never published). Grant SELECT on it to this role, or look as its owner")

    def start(self) -> None:
        """Run a round every ``interval_s`` on a thread of its own until :meth:`stop`.
        Idempotent; a stopped janitor does not start again."""
        if self._thread is None and not self._stopping.is_set():
            self._thread = threading.Thread(target=self._run, name="outbox-relay-janitor",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the round under way, waiting for it up to ``timeout_s`` (0: only ask).
        The thread closes its connection as it ends; a janitor never started closes it
        here.  Idempotent."""
        first = not self._stopping.is_set()
        self._stopping.set()
        if self._thread is None:
            if first:
                self.store.close()
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        """Database errors are logged and waited out (the next round reconnects), never raised."""
        try:
            self._rounds()
        finally:
            self.store.close()  # the connection is this thread's

    def _rounds(self) -> None:
        down = False
        while not self._stopping.is_set():
            try:
                self.run_once()
                if down and self.log is not None:
                    self.log.info("cleanup_recovered")
                down = False
            except DatabaseUnavailable as exc:
                if not down and self.log is not None:
                    self.log.warning("cleanup_database_unavailable", error=str(exc))
                down = True
                self.store.reset()
            except RelayError as exc:  # e.g. no DELETE privilege: says so each round
                if self.log is not None:
                    self.log.error("cleanup_failed", error=str(exc))
            except Exception as exc:  # noqa: BLE001 - a round's failure must not end the thread
                # Anything else ended the thread with a traceback, retention and partition
                # maintenance stopped for good while the relay said it was healthy.
                if self.log is not None:
                    self.log.error("cleanup_failed", error=f"{type(exc).__name__}: {exc}"[:500])
                self.store.reset()
            self._stopping.wait(self.interval_s)
