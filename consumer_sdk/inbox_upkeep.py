"""The upkeep of :class:`~consumer_sdk.inbox.InboxConsumer`: waiting for the database
(with back-off, until it answers or stop()), checking the inbox's retention against the
topics' and deleting the inbox rows past it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from consumer_sdk import kafka
from consumer_sdk.errors import DatabaseUnavailable, RetriableError
from consumer_sdk.inbox_state import InboxState
from consumer_sdk.retention import check_retention, cleanup_inbox, report_retention
from outbox_core.backoff import backoff_s


class InboxUpkeep(InboxState):
    """Database waits, the retention check and the inbox cleanup."""

    def _retry_db(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` until the database answers (or stop()); returns its value or None."""
        failures = 0
        while not self.stopping:
            try:
                value = call()
                return True if value is None else value
            except DatabaseUnavailable as exc:
                failures += 1
                if failures == 1:
                    self.log.warning("database_unavailable", error=str(exc))
                self.store.reset()
                self._stop.wait(self._db_backoff_s(failures))
        return None

    def _db_backoff_s(self, failures: int) -> float:
        c = self.config
        return backoff_s(failures, initial_s=c.db_backoff_initial_s, max_s=c.db_backoff_max_s, jitter=0)


    def _check_retention(self) -> None:
        try:
            self.retention = check_retention({"logger": kafka.LIBRDKAFKA_LOG, **self.config.shared_kafka()},
                                             list(self.config.topics),
                                             self.config.inbox_retention_s)
        except Exception as exc:  # noqa: BLE001 - a missing check must not stop the consumer
            self.log.warning("inbox_retention_unchecked", error=str(exc))
            return
        report_retention(self.retention, consumer=self.config.name, metrics=self.metrics, log=self.log)

    def _maybe_cleanup(self) -> int:
        retention_s = self.config.inbox_retention_s
        now = self._clock()
        if retention_s is None or now < self._next_cleanup:
            return 0
        self._next_cleanup = now + self.config.cleanup_interval_s
        try:
            deleted = cleanup_inbox(self.store, consumer=self.config.name, retention_s=retention_s,
                                    batch=self.config.cleanup_batch)
        except RetriableError as exc:
            self.log.warning("inbox_cleanup_failed", error=str(exc))
            return 0
        if deleted:
            self.metrics.inbox_cleanup_deleted.labels(self.config.name).inc(deleted)
            self.log.info("inbox_cleaned", deleted=deleted, retention_s=retention_s)
        return deleted
