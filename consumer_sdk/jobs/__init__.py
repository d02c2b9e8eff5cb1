"""Durable runs and jobs: accept once, claim without double owners, fence every write.

Accepting (a service's HTTP handler)::

    from consumer_sdk.jobs import accept, AdmissionPolicy
    run = accept(conn, owner_id=user, request_key=idempotency_key, kind="report",
                 body=request_json, traceparent=headers.get("traceparent"),
                 admission=AdmissionPolicy(capacity_per_s=5, horizon_s=60))
    # 202 Accepted, Location: /runs/{run.run_id}

Working (a worker process)::

    from consumer_sdk.jobs import WorkerConfig, WorkerPool

    def report(ctx):
        with ctx.fenced_transaction() as conn:      # commits only while the lease holds
            conn.execute(...)                       # the handler's own writes
        ctx.put_result("page-1", {...})             # results by key: no duplicates
        return {"pages": 1}                         # succeeded, with this result

    pool = WorkerPool(WorkerConfig(dsn=dsn, queue_limits={"bulk": 7}, owner_limit=4),
                      {"report": report})
    pool.start(); ...; pool.stop()

Schema: ``sql/migrations/0005_jobs.sql``; queries: ``sql/queries/jobs.sql``.
"""

from __future__ import annotations

from consumer_sdk.jobs import aio
from consumer_sdk.jobs.config import WorkerConfig
from consumer_sdk.jobs.context import JobContext
from consumer_sdk.jobs.errors import (
    AdmissionRefused,
    DatabaseReadOnly,
    FencedTransactionAborted,
    HandlerTimedOut,
    InvalidJob,
    JobsError,
    LeaseLost,
    PermanentJobError,
    PrivilegeMissing,
    RequestKeyConflict,
    RunNotFound,
    StatementTimedOut,
    TableMissing,
    TransactionActive,
    TransientJobError,
)
from consumer_sdk.jobs.executor import Handler
from consumer_sdk.jobs.fairness import Limits, RoundRobin, plan
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import (
    BULK,
    INTERACTIVE,
    Accepted,
    Activation,
    AdmissionPolicy,
    ClaimedJob,
    DeadLetterRecord,
    JobId,
    JobStatus,
    Lease,
    NewJob,
    RunId,
    RunState,
    Token,
    WaitFor,
)
from consumer_sdk.jobs.queue import enqueue
from consumer_sdk.jobs.reconciler import Reconciler, ReconcileResult
from consumer_sdk.jobs.refusals import PoolHealth
from consumer_sdk.jobs.retry import Backoff
from consumer_sdk.jobs.runs import accept, body_sha256, cancel_run, owner_view, results, run_status
from consumer_sdk.jobs.waits import activate, resume_job
from consumer_sdk.jobs.wake import Listener, activation_handler, wake_handler
from consumer_sdk.jobs.worker import WorkerPool

__all__ = [
    "BULK",
    "INTERACTIVE",
    "Accepted",
    "Activation",
    "AdmissionPolicy",
    "AdmissionRefused",
    "Backoff",
    "ClaimedJob",
    "DatabaseReadOnly",
    "DeadLetterRecord",
    "FencedTransactionAborted",
    "Handler",
    "HandlerTimedOut",
    "InvalidJob",
    "JobContext",
    "JobId",
    "JobStatus",
    "JobsError",
    "JobsMetrics",
    "Lease",
    "LeaseLost",
    "Limits",
    "Listener",
    "NewJob",
    "PermanentJobError",
    "PoolHealth",
    "PrivilegeMissing",
    "ReconcileResult",
    "Reconciler",
    "RequestKeyConflict",
    "RoundRobin",
    "RunId",
    "RunNotFound",
    "RunState",
    "StatementTimedOut",
    "TableMissing",
    "Token",
    "TransactionActive",
    "TransientJobError",
    "WaitFor",
    "WorkerConfig",
    "WorkerPool",
    "accept",
    "activate",
    "activation_handler",
    "aio",
    "body_sha256",
    "cancel_run",
    "enqueue",
    "owner_view",
    "plan",
    "resume_job",
    "results",
    "run_status",
    "wake_handler",
]
