"""Every metric of runs and jobs, declared once, on an injected registry.

Names carry the prefix ``outbox_jobs_``.  Labels are bounded: the queue (a
handful of names the service chooses), a terminal status, a dead-letter reason,
a resume cause.  Never an owner id, a run id or a kind a client could invent.
Counters count what a database commit made true (a claim, a transition) or what
a worker really saw (a lost lease).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

AGE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600)
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
ATTEMPT_BUCKETS = (1, 2, 3, 4, 5, 7, 10, 15, 25)
#: Why an attempt failed through no fault of its job (consumer_sdk.jobs.retry's Interruption, as
#: outbox_jobs_interrupted_total's causes).  Declared here, as ReconcileStep below, so that the
#: retry module's type and the metric's label values are one list (retry imports psycopg,
#: which this module does not).
Interruption = Literal["connection_broke", "conflict", "read_only"]
INTERRUPTION_CAUSES: tuple[Interruption, ...] = get_args(Interruption)
#: outbox_jobs_given_back_total's causes: the interruptions, a pooler's lost statement, and the
#: interruptions past the pool's max_interruptions (counted, not given back).
GIVEN_BACK_CAUSES = (*INTERRUPTION_CAUSES, "prepared_statement_lost", "interruptions_exhausted")
#: A reconcile pass's steps (consumer_sdk.jobs.reconciler's Step), as a timed-out one is named:
#: resuming parked jobs, reaping expired leases, refreshing the queue gauges.  Declared here,
#: where the reconciler (which imports this module) takes it from, so that its steps and
#: outbox_jobs_reconcile_timed_out's label values (RECONCILE_STEPS, each at 0) are one list.
ReconcileStep = Literal["resume", "reap", "stats"]
RECONCILE_STEPS: tuple[ReconcileStep, ...] = get_args(ReconcileStep)


class JobsMetrics:
    """The jobs metrics on ``registry`` (a fresh private one when not given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.accepted = Counter("outbox_jobs_runs_accepted", "Runs accepted (new runs only).",
                                ["queue"], registry=r)
        self.admission_refused = Counter(
            "outbox_jobs_admission_refused", "Accepts refused because the queue's backlog exceeds its horizon.",
            ["queue"], registry=r)
        self.claimed = Counter("outbox_jobs_claimed", "Jobs claimed (each attempt counts).", ["queue"],
                               registry=r)
        self.finished = Counter("outbox_jobs_finished", "Jobs that reached a terminal status.",
                                ["queue", "status"], registry=r)
        self.accept_to_terminal = Histogram(
            "outbox_jobs_accept_to_terminal_seconds", "From accepting a job to its terminal status.",
            ["queue", "status"], buckets=AGE_BUCKETS_S, registry=r)
        self.attempts = Histogram(
            "outbox_jobs_attempts", "Attempts a job took, observed when it reached a terminal status.",
            ["queue"], buckets=ATTEMPT_BUCKETS, registry=r)
        self.retries = Counter("outbox_jobs_retries", "Failed attempts scheduled for a retry.", ["queue"],
                               registry=r)
        self.lease_expirations = Counter(
            "outbox_jobs_lease_expirations", "Running jobs whose lease expired and that were reaped.",
            ["queue"], registry=r)
        self.leases_lost = Counter(
            "outbox_jobs_leases_lost", "Attempts that ended without a write of their own, by reason: lease_lost, "
            "lease_unconfirmed, cancelled, write_refused, write_failed.",
            ["queue", "reason"], registry=r)
        self.given_back = Counter(
            "outbox_jobs_given_back", "Attempts given back with the attempt not counted, by cause: "
            "connection_broke (the database connection broke under the handler), conflict (a deadlock or a "
            "serialization failure), read_only (the database was read-only: a failover), each up to the pool's "
            "max_interruptions a job in all; prepared_statement_lost (a transaction pooler lost psycopg's "
            "statement).  And interruptions_exhausted: attempts that failed so, NOT given back but counted, "
            "their job past max_interruptions (one that meets it every time, or a database in trouble for "
            "longer than the budget lasts).", ["queue", "cause"], registry=r)
        self.dead_lettered = Counter("outbox_jobs_dead_lettered", "Jobs failed and dead-lettered.",
                                     ["queue", "reason"], registry=r)
        self.resumed = Counter("outbox_jobs_resumed", "Parked jobs resumed by the reconciler, by cause.",
                               ["queue", "cause"], registry=r)
        self.parked = Counter("outbox_jobs_parked", "Jobs parked in 'waiting'.", ["queue"], registry=r)
        self.handler_duration = Histogram(
            "outbox_jobs_handler_duration_seconds", "Time a handler ran, per attempt.", ["queue"],
            buckets=DURATION_BUCKETS_S, registry=r)
        #: A worker pool reads its own count when scraped (set_function), per queue it serves.
        self.workers_busy = Gauge("outbox_jobs_workers_busy", "Jobs this pool is running now.", ["queue"],
                                  registry=r)
        #: A worker pool reads its own running attempts when scraped (set_function), per queue.
        self.oldest_running_age = Gauge(
            "outbox_jobs_oldest_running_age_seconds", "How long the oldest handler this pool is running "
            "has run (0 when none runs).", ["queue"], registry=r)
        self.workers_capacity = Gauge("outbox_jobs_workers_capacity", "Jobs this pool may run at once.",
                                      registry=r)
        #: A worker pool reads its own line's bytes when scraped (set_function: consumer_sdk.jobs.line).
        self.payload_bytes_held = Gauge(
            "outbox_jobs_payload_bytes_held", "Payload bytes of the jobs this pool holds (claimed, until "
            "their attempts end), as its claims counted them: at its max_payload_bytes, free slots wait "
            "for a job to end.", registry=r)
        self.payload_bytes_limit = Gauge(
            "outbox_jobs_payload_bytes_limit", "This pool's max_payload_bytes: past it, it claims nothing.",
            registry=r)
        #: A worker pool reads its own timed-out handlers when scraped (set_function).
        self.handlers_stuck = Gauge(
            "outbox_jobs_handlers_stuck", "Handlers this pool timed out (handler_timeout_s) that have not "
            "returned: each holds its thread and a worker slot until it does.", registry=r)
        #: A worker pool's lock-wait watch sets it at each look (consumer_sdk.jobs.lock_waits), per queue.
        self.lock_wait = Gauge(
            "outbox_jobs_lock_wait_seconds", "How long this pool's dispatcher (claims) or heartbeat (lease "
            "renewals) has waited for a database lock another session holds: the longer of the two at the "
            "pool's lock-wait watch's last look (0: none).", ["queue"], registry=r)
        self.oldest_pending_age = Gauge(
            "outbox_jobs_oldest_pending_age_seconds", "Age of the oldest ready job (since it became claimable).",
            ["queue"], registry=r)
        self.pending = Gauge("outbox_jobs_pending", "Jobs ready to run and not claimed.", ["queue"], registry=r)
        self.running = Gauge("outbox_jobs_running", "Jobs running in every worker.", ["queue"], registry=r)
        self.waiting = Gauge("outbox_jobs_waiting", "Jobs parked in 'waiting'.", ["queue"], registry=r)
        self.heartbeat_failures = Counter(
            "outbox_jobs_heartbeat_failures", "Heartbeats that failed to reach the database.", registry=r)
        self.dispatch_refusals = Counter(
            "outbox_jobs_dispatch_refusals", "The pool's own claims or reaps the database refused (a trigger, "
            "a constraint, a policy), by statement.", ["statement"], registry=r)
        self.dispatch_refused = Gauge(
            "outbox_jobs_dispatch_refused", "1 while the database refuses the pool's claim or reap "
            "(tried again with back-off), by statement.", ["statement"], registry=r)
        #: A worker pool reads its own dispatcher's state when scraped (set_function: consumer_sdk.jobs.outage).
        self.database_unavailable = Gauge(
            "outbox_jobs_database_unavailable", "1 while this pool's dispatch rounds keep failing because the "
            "database is unavailable or read-only (a standby, a failover), or a round has gone unanswered "
            "for 10 s (a partition): it claims nothing and is not ready.",
            registry=r)
        self.reconcile_timed_out = Counter(
            "outbox_jobs_reconcile_timed_out", "Steps of a worker pool's reconcile passes and reaps that its "
            "pool_statement_timeout_s cancelled, by step: resume (parked jobs whose activation or timeout came), "
            "reap (running jobs whose lease expired), stats (the queue gauges). Each is skipped and held off, "
            "longer while it keeps timing out: meanwhile its work waits.", ["step"], registry=r)
        for step in RECONCILE_STEPS:  # at 0 from the start: an alert sees the first timeout as an increase
            self.reconcile_timed_out.labels(step)
        # Children looked up once (labels are bounded: queues and statuses; never removed).
        self._per_queue: dict[str, tuple[Any, Any, Any]] = {}
        self._per_terminal: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def observe_terminal(self, queue: str, status: str, *, age_s: float | None, attempts: int) -> None:
        """A job reached ``status`` (succeeded, failed, cancelled) ``age_s`` after it was accepted."""
        finished, age, tries = self._terminal(queue, status)
        finished.inc()
        if age_s is not None:
            age.observe(max(0.0, age_s))
        tries.observe(attempts)

    def per_queue(self, queue: str) -> tuple[Any, Any, Any]:
        """(claimed, workers_busy, handler_duration) of ``queue``: the children a pool updates
        often, looked up once (``labels()`` takes a lock and builds a key each call)."""
        found = self._per_queue.get(queue)
        if found is None:
            found = self._per_queue[queue] = (self.claimed.labels(queue), self.workers_busy.labels(queue),
                                              self.handler_duration.labels(queue))
        return found

    def serve(self, queue: str) -> None:
        """Create ``queue``'s series of every give-back cause at 0, as the relay does for its
        counters: a series that first appears at 1 is
        no increase to ``increase()``, and an alert on the first give-back never fired.  For each
        queue a worker pool serves, when it starts."""
        for cause in GIVEN_BACK_CAUSES:
            self.given_back.labels(queue, cause)

    def _terminal(self, queue: str, status: str) -> tuple[Any, Any, Any]:
        found = self._per_terminal.get((queue, status))
        if found is None:
            found = self._per_terminal[(queue, status)] = (
                self.finished.labels(queue, status), self.accept_to_terminal.labels(queue, status),
                self.attempts.labels(queue))
        return found
