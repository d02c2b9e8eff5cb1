"""A batch's new messages at once, a part of :class:`~consumer_sdk.processor.Processor`: the
batch handler, or the statements of every new message in one round trip, in one savepoint;
the batch goes one message at a time when that fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.model import Claim, InboxMessage
from consumer_sdk.processor_state import ProcessorState
from consumer_sdk.processor_statements import _checked
from consumer_sdk.rejections import describe


class ProcessorBatches(ProcessorState):
    """A batch's new messages applied at once."""

    def _apply_batch(self, conn: Any, messages: Sequence[InboxMessage], claims: Sequence[Claim | None]) -> bool:
        """The batch handler on all new messages in one savepoint; False (rolled back) when
        something other than new or duplicate came, or when it failed."""
        assert self._batch_handler is not None
        batch_handler = self._batch_handler

        def apply(fresh: list[InboxMessage]) -> None:
            with self._store.attempt():
                batch_handler(conn, fresh)
                if self._store.in_failed_transaction():  # judged in _apply_fresh like a raised error
                    raise self._transaction_failed()

        return self._apply_fresh(messages, claims, apply, failed="batch_handler_failed")

    def _apply_statements(self, messages: Sequence[InboxMessage], claims: Sequence[Claim | None]) -> bool:
        """The statements of every new message in one pipeline (one round trip), in one
        savepoint; False (rolled back, or nothing sent) when something other than new or
        duplicate came, when the statements handler raised or answered wrongly, or when a
        statement failed: then the batch goes one message at a time, where each failure is
        judged."""
        assert self._batch_statements is not None
        statements_of = self._batch_statements

        def ready() -> bool:
            if self._store.can_pipeline():  # type: ignore[attr-defined]
                return True
            self._batch_statements = None  # no pipeline mode here: one by one from now on
            return False

        def apply(fresh: list[InboxMessage]) -> None:
            statements = [pair for message in fresh for pair in _checked(statements_of(message))]
            with self._store.attempt():
                self._store.execute_all(statements)  # type: ignore[attr-defined]

        return self._apply_fresh(messages, claims, apply, failed="statements_batch_failed", ready=ready)

    def _apply_fresh(self, messages: Sequence[InboxMessage], claims: Sequence[Claim | None],
                     apply: Callable[[list[InboxMessage]], None], *, failed: str,
                     ready: Callable[[], bool] = lambda: True) -> bool:
        """``apply`` to the batch's new messages at once (its own savepoint); True when it
        went through or nothing was new, False (one message at a time next) when something
        other than new or duplicate came, when ``ready`` says no, or when ``apply`` failed
        (logged as ``failed``).  A broken connection propagates: the batch is retried whole."""
        if any(claim not in ("new", "duplicate") for claim in claims):
            return False
        fresh = [m for m, claim in zip(messages, claims, strict=True) if claim == "new"]
        if not fresh:
            return True
        if not ready():
            return False
        try:
            apply(fresh)
        except Exception as exc:  # noqa: BLE001 - one by one next, where each failure is judged
            if isinstance(exc, DatabaseUnavailable):
                raise  # the connection broke: the batch is retried as a whole
            failure = self._database_failure(exc)
            if failure is not None:  # the database failed under it (read-only, a deadlock...): idem
                raise failure from exc
            self._log.info(failed, messages=len(fresh), error=describe(exc),
                           hint="applying the batch one message at a time")
            return False
        return True
