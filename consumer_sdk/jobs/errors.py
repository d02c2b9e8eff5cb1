"""Errors of runs and jobs; all subclass the SDK root :class:`~consumer_sdk.errors.OutboxSdkError`.

Each class's docstring is its default message.  Retryability lives in the type:

* a handler raises :class:`PermanentJobError` (or the SDK's
  :class:`~consumer_sdk.errors.PermanentError`) for a job that can never succeed:
  it is failed and dead-lettered at once; :class:`TransientJobError` (or any
  other exception) is retried with back-off until the attempts run out;
* :class:`LeaseLost` means the worker no longer owns the job: it must stop and
  write nothing more (the fenced writes would update zero rows anyway);
* :class:`AdmissionRefused` carries ``retry_after_s`` for an HTTP ``Retry-After``;
* the database's refusals are translated at the seam (:mod:`consumer_sdk.jobs._db`): a
  refusal of the row written (a constraint, a trigger, a value or a size it cannot store)
  is :class:`InvalidJob`, which fails that job for good; a missing grant is
  :class:`PrivilegeMissing`, a :class:`~consumer_sdk.errors.FatalError` that stops a pool; a
  missing table is :class:`~consumer_sdk.errors.SchemaMissing` when the jobs statement names it
  (the jobs schema), :class:`TableMissing` when a trigger or function it ran does; a
  read-only database (a standby) is :class:`DatabaseReadOnly`, waited for as an unreachable one;
  a statement its ``statement_timeout`` cancelled is :class:`StatementTimedOut`, retried as one.
"""

from __future__ import annotations

from consumer_sdk.errors import (
    DatabaseUnavailable,
    FatalError,
    HandlerTransactionFailed,
    OutboxSdkError,
    PermanentError,
    RetriableError,
    SchemaMissing,
)


class JobsError(OutboxSdkError):
    """A runs-and-jobs operation failed."""


class LeaseLost(JobsError):
    """The worker lost its lease on the job (expired, taken over or cancelled): it writes nothing more.

    ``reason`` is one of ``lease_lost`` (a fenced write or heartbeat matched no
    row), ``lease_unconfirmed`` (heartbeats failed until the local deadline),
    ``cancelled`` (the run's owner cancelled it), ``shutdown`` (the pool is
    stopping and gives the job back).
    """

    def __init__(self, message: str | None = None, *, reason: str = "lease_lost") -> None:
        super().__init__(message)
        self.reason = reason


class AdmissionRefused(JobsError):
    """The queue already holds more work than can be done within its horizon; retry later.

    ``retry_after_s`` (whole seconds, at least 1) estimates when the backlog will
    be back under the bound; ``pending`` is the backlog counted (a lower bound).
    """

    def __init__(self, message: str | None = None, *, queue: str, retry_after_s: int,
                 pending: int) -> None:
        super().__init__(message)
        self.queue = queue
        self.retry_after_s = retry_after_s
        self.pending = pending


class RequestKeyConflict(JobsError, ValueError):
    """This request key was already used by this owner with a different body; it is never reinterpreted."""

    def __init__(self, message: str | None = None, *, run_id: object = None) -> None:
        super().__init__(message)
        self.run_id = run_id


class RunNotFound(JobsError, LookupError):
    """No such run for this owner."""


class TransactionActive(JobsError):
    """accept() commits its own transaction: call it on a connection that is not inside one."""


class InvalidJob(JobsError, ValueError):
    """The run or job cannot be stored (owner, key, queue, body, or wait condition)."""


class PermanentJobError(JobsError, PermanentError):
    """Raised by a handler: this job can never succeed; fail it and dead-letter it without retrying."""


class TransientJobError(JobsError, RetriableError):
    """Raised by a handler: this attempt failed for a passing reason; retry it with back-off."""


class HandlerTimedOut(TransientJobError):
    """The attempt's handler ran past ``WorkerConfig.handler_timeout_s``: the attempt failed
    (retried, or dead-lettered when it was the last), written by the pool, not the handler."""


class PrivilegeMissing(JobsError, FatalError):
    """The database role lacks a privilege the jobs need: grant it to the role of the DSN.

    A deployment error, the same for every job: a worker pool that meets it stops claiming
    (``pool.error``, the ``pool_failed`` log line), so that no job is claimed, its attempt
    counted, and its outcome left unwritten."""


class TableMissing(JobsError, SchemaMissing):
    """A trigger or function the jobs statement ran uses a table that does not exist: create it or fix the function.

    Not the jobs schema (that is :class:`~consumer_sdk.errors.SchemaMissing` itself): the
    statement's own tables are there, a trigger on one of them (an audit trigger, most
    often) or a function it called reads or writes a table that was dropped.  The message
    names the table and the function.  A worker pool treats it as a refusal of its
    statement (:mod:`consumer_sdk.jobs.refusals`): tried again with back-off until the
    table is back or the function fixed."""


class DatabaseReadOnly(JobsError, DatabaseUnavailable):
    """The database is read-only (a standby, or a primary during a failover): waiting for a writable one.

    SQLSTATE 25006.  Waited for as an unreachable database, on new connections (a session
    keeps its read-only setting; a multi-host DSN with ``target_session_attrs=read-write``
    finds the new primary only on a new one).  A worker pool stopped for good on it
    before (a FatalError), until a person restarted it (an audit of the pool)."""


class StatementTimedOut(JobsError, DatabaseUnavailable):
    """The server cancelled a statement that ran past its session's ``statement_timeout``: the database answers, slowly.

    SQLSTATE 57014 (an overloaded server, a large scan, a lock held long).  Retried like any
    :class:`~consumer_sdk.errors.DatabaseUnavailable`; its own type so that the pool's log (and a
    caller of ``accept``, ``enqueue``... that wants to answer "timed out") says what cancelled it.
    The pool's own statements run with ``WorkerConfig.pool_statement_timeout_s``, other
    sessions with the role's or the database's ``statement_timeout``.  On the pool's own
    sessions it is told by the client's clock under any ``lc_messages`` (a 57014 ending a wait
    as long as that timeout: :mod:`consumer_sdk.jobs.statement_clock`), elsewhere by
    PostgreSQL's English message only."""


class FencedTransactionAborted(JobsError, HandlerTransactionFailed):
    """The handler caught a database error inside fenced_transaction() and carried on: its transaction was rolled back, nothing written.

    The server had aborted the transaction at that error, and COMMIT of an aborted transaction
    answers ROLLBACK without an error: the block ended as if it had committed, and the job was
    recorded as succeeded with its writes lost.  Raised by ``fenced_transaction()`` when the
    block ends with the transaction aborted; the message names the error caught (its SQLSTATE
    and first line) when the connection saw it.  The attempt fails as any handler failure
    (retried, counted); a database conflict (class 40) or a read-only database (25006) caught
    so is raised as :class:`~consumer_sdk.errors.TransactionConflict` or
    :class:`DatabaseReadOnly` instead, as if the handler had not caught it."""
