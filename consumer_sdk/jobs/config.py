"""The worker pool's settings: one frozen, keyword-only object with units in the names."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from consumer_sdk.config import check_db_spin_us
from consumer_sdk.jobs import _check
from consumer_sdk.jobs.claims import DEFAULT_MAX_PAYLOAD_BYTES
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.fairness import Limits
from consumer_sdk.jobs.metrics import JobsMetrics
from consumer_sdk.jobs.model import BULK, INTERACTIVE
from consumer_sdk.jobs.retry import Backoff
from consumer_sdk.secrets import safe_repr, validate_dsn

DEFAULT_LEASE_S = 30.0
DEFAULT_POLL_INTERVAL_S = 5.0
DEFAULT_RECONCILE_INTERVAL_S = 10.0
DEFAULT_DRAIN_TIMEOUT_S = 10.0
DEFAULT_RUNNING_LONG_AFTER_S = 600.0
#: A job's attempts the database connection may break under without counting (see
#: WorkerConfig.max_interruptions): a failover or two in a job's life, not a loop.
DEFAULT_MAX_INTERRUPTIONS = 10
MAX_INTERRUPTIONS = 10_000

#: Bounds of the durations (seconds).  A lease shorter than the relay's (relay/config.py
#: MIN_LEASE_S) expires under a healthy worker; none may exceed a day.
MIN_LEASE_S = 1.0
MIN_HEARTBEAT_S = 0.1
MAX_DURATION_S = 86_400.0
MAX_OWNERS_PER_ROUND = 100_000
#: PostgreSQL keeps the first 63 bytes of application_name (NAMEDATALEN - 1).
MAX_APPLICATION_NAME_CHARS = 63
#: The pool's own statements' statement_timeout (WorkerConfig.pool_statement_timeout_s): past
#: the outage watch's 10 s and the lock-wait watch's first look (5 s), within the default lease.
DEFAULT_POOL_STATEMENT_TIMEOUT_S = 20.0
#: The largest max_payload_bytes (1 TiB): past any process's memory.
MAX_PAYLOAD_BYTES = 2**40


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How one worker pool (one process, usually) claims and runs jobs.

    * ``queues``: the queues served, in priority order (interactive first).
    * ``max_concurrency``: jobs this pool runs at once (one thread and one
      connection each); ``queue_limits`` caps a queue within it, e.g.
      ``{"bulk": max_concurrency - 1}`` keeps a slot for interactive work.
    * ``owner_limit`` / ``owner_limits``: jobs of one owner running at once across
      every worker of the database (enforced in the claim's SQL).
    * ``lease_duration_s``: how long a claim or heartbeat holds a job;
      ``heartbeat_interval_s`` (default a third of it) how often leases are renewed.
      The names are the relay's (``--lease-duration-s``, ``--heartbeat-interval-s``);
      ``lease_s`` and ``heartbeat_s`` are deprecated aliases that still work.  They also
      set the TCP keep-alives and ``tcp_user_timeout`` (one lease) of the pool's
      connections, where the DSN does not (:func:`consumer_sdk.jobs._conn.tcp_options`).
    * ``poll_interval_s``: the safety net; losing every wake-up (NOTIFY, Kafka)
      delays work by at most this much.
    * ``reconcile_interval_s``: how often parked jobs whose wake-up was lost are
      resumed, and the queue gauges refreshed.
    * ``events_topic``: when set, terminal transitions write an event to the outbox.
    * ``drain_timeout_s``: on stop, how long running handlers may finish before
      they are asked to stop and their jobs are given back; ``stop()`` returns within
      ``drain_timeout_s`` + 5 s (``worker.STOP_GRACE_S``) whatever the database does.
    * ``max_owners_per_round``: the owners with ready work one read of the lanes lists
      per queue; with more, the reads take turns (:mod:`consumer_sdk.jobs.lanes`).
    * ``running_long_after_s``: a handler that has run this long (10 minutes by default) is
      logged once, ``job_running_long`` (job, queue, kind, attempt, how long): a handler that
      never returns keeps its job and its slot, its lease renewed; the gauge
      ``outbox_jobs_oldest_running_age_seconds`` shows it too.
    * ``handler_timeout_s``: None (the default: long work is legitimate), or how long a
      handler may run: past it the attempt is cancelled (reason ``timed_out``), its lease no
      longer renewed, and its failure (``handler timed out after N s``: a retry, or the dead
      letter after the last attempt) written by the pool under its lease token; checked at
      each heartbeat.  A handler that ignores the cancellation keeps its thread and slot
      until it returns (:mod:`consumer_sdk.jobs.timeouts`).  Not per queue.
    * ``pool_statement_timeout_s``: the ``statement_timeout`` of the pool's own statements (its
      claims, lease renewals, reaps, reconciles and lock-wait look; never the handler's
      connection), 20 s by default, 0 for none (the role's or database's applies).  A statement
      cancelled by it (an overloaded server, a large scan, a lock held that long) is logged with
      the statement and the setting, and tried again at the next round.  Not set behind a
      transaction pooler (it would stay on the pooler's shared server sessions).
    * ``db_spin_us``: how long a wait for the database's answer polls the socket before
      sleeping on it (:mod:`outbox_core.spin`).  Off by default: with a pool's threads
      polling at once, they compete for the interpreter and the cores (measured: 0.74 x
      the jobs a second, 1.5 x the CPU a job, with 8 threads at 100 µs).
    * ``max_interruptions``: how many of a job's attempts may fail through no fault of its
      own without counting against its ``max_attempts``, one budget for three causes: the
      database connection broke under the handler (the network dropped; a pooler, a failover
      or an administrator ended the backend: SQLSTATE 57P01-57P03, class 08), a conflict (class
      40: a deadlock, a serialization failure) or a read-only database (25006: a failover in
      progress, a pooler routing to a standby).  Such a job is given back (``job_given_back``
      with its cause), due again after the first retry's back-off (a conflict: a short
      jittered pause; read-only: the back-off growing with each read-only one).  Past it (a
      job that deadlocks or breaks its connection every time) each attempt counts again
      (``job_interruptions_exhausted``), and the dead letter says how many of each.  10 by
      default; 0 counts every attempt, as before.
    * ``max_payload_bytes``: the payload bytes the pool holds at once (64 MiB by default):
      each job's payload (or its run's goal) and activation payload, uncompressed (a
      compressed value counts its text's length), held from its claim until its attempt ends
      (whatever the outcome).  A round claims with what the limit leaves, in the plan's order
      (one job per lane per turn) up to the job that crosses it, that one included; once the
      held bytes reach the limit, free slots wait and a job ending wakes the next round.  So
      the pool holds at most the limit plus one job, and a job over the limit still runs (it
      is claimed as soon as the held bytes are under the limit, and nothing more is claimed
      while it runs).  The gauge ``outbox_jobs_payload_bytes_held`` shows what is held.

    Everything is checked at construction; a ``dsn`` that is not a libpq connection string
    raises :class:`~consumer_sdk.errors.ConfigError`, as every DSN of the SDK does, and any
    other bad value :class:`~consumer_sdk.jobs.errors.InvalidJob` (both ``ValueError``)
    naming it:

    * ``queues``: a list or tuple (not a str) of distinct queue names;
    * ``max_concurrency`` an int from 1 to 10,000; ``queue_limits`` ints >= 0 for queues
      in ``queues`` only; ``owner_limit`` and ``owner_limits`` (str owner ids) ints >= 1;
    * ``lease_duration_s`` from 1 s (the relay's minimum lease) to 1 day;
      ``heartbeat_interval_s`` from 0.1 s to half the lease; ``poll_interval_s`` and
      ``reconcile_interval_s``, ``running_long_after_s`` and ``handler_timeout_s`` (or
      None) above 0 up to 1 day;
      ``drain_timeout_s`` and ``pool_statement_timeout_s`` 0 to 1 day;
      all finite numbers;
    * ``events_topic`` None or a Kafka topic name (1-249 of ``[A-Za-z0-9._-]``, not
      ``.`` or ``..``); ``worker_id`` None or 1-200 characters; ``application_name`` a
      string of at most 63 ASCII characters; ``backoff`` a :class:`Backoff`;
      ``listen`` a bool; ``max_owners_per_round`` an int from 1 to 100,000;
      ``max_interruptions`` an int from 0 to 10,000; ``max_payload_bytes`` an int from 1 to 2**40.
    """

    dsn: str
    queues: Sequence[str] = (INTERACTIVE, BULK)
    max_concurrency: int = 8
    queue_limits: Mapping[str, int] = field(default_factory=dict)
    owner_limit: int = 1_000_000
    owner_limits: Mapping[str, int] = field(default_factory=dict)
    lease_duration_s: float = DEFAULT_LEASE_S
    heartbeat_interval_s: float | None = None  # None: a third of the lease (heartbeat_every_s)
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    reconcile_interval_s: float = DEFAULT_RECONCILE_INTERVAL_S
    backoff: Backoff = field(default_factory=Backoff)
    events_topic: str | None = None
    listen: bool = True
    worker_id: str | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    max_owners_per_round: int = 500
    application_name: str = "outbox-jobs-worker"
    running_long_after_s: float = DEFAULT_RUNNING_LONG_AFTER_S
    handler_timeout_s: float | None = None  # None: no limit (long work is legitimate)
    pool_statement_timeout_s: float = DEFAULT_POOL_STATEMENT_TIMEOUT_S  # 0: none (the role's applies)
    db_spin_us: float = 0.0  # off: a pool's threads would poll against each other (README)
    max_interruptions: int = DEFAULT_MAX_INTERRUPTIONS
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    lease_s: float | None = None  # deprecated alias of lease_duration_s
    heartbeat_s: float | None = None  # deprecated alias of heartbeat_interval_s

    def __post_init__(self) -> None:
        validate_dsn(self.dsn, option="WorkerConfig.dsn")
        self._resolve_aliases()
        self._check_queues()
        _check.seconds("lease_duration_s", self.lease_duration_s, MIN_LEASE_S, MAX_DURATION_S)
        if self.heartbeat_interval_s is not None:
            _check.seconds("heartbeat_interval_s", self.heartbeat_interval_s, MIN_HEARTBEAT_S,
                           self.lease_duration_s / 2)
        _check.seconds("poll_interval_s", self.poll_interval_s, 0.0, MAX_DURATION_S, lo_open=True)
        _check.seconds("reconcile_interval_s", self.reconcile_interval_s, 0.0, MAX_DURATION_S, lo_open=True)
        _check.seconds("drain_timeout_s", self.drain_timeout_s, 0.0, MAX_DURATION_S)
        _check.seconds("pool_statement_timeout_s", self.pool_statement_timeout_s, 0.0, MAX_DURATION_S)
        _check.seconds("running_long_after_s", self.running_long_after_s, 0.0, MAX_DURATION_S, lo_open=True)
        if self.handler_timeout_s is not None:
            _check.seconds("handler_timeout_s", self.handler_timeout_s, 0.0, MAX_DURATION_S, lo_open=True)
        check_db_spin_us(self.db_spin_us, error=InvalidJob)
        if not isinstance(self.backoff, Backoff):
            raise InvalidJob(f"backoff must be a Backoff, got {self.backoff!r:.80}")
        _check.topic("events_topic", self.events_topic)
        if not isinstance(self.listen, bool):
            raise InvalidJob(f"listen must be a bool, got {self.listen!r:.80}")
        if self.worker_id is not None:
            _check.text("worker_id", self.worker_id)
        _check.integer("max_owners_per_round", self.max_owners_per_round, 1, MAX_OWNERS_PER_ROUND)
        _check.integer("max_interruptions", self.max_interruptions, 0, MAX_INTERRUPTIONS)
        _check.integer("max_payload_bytes", self.max_payload_bytes, 1, MAX_PAYLOAD_BYTES)
        name = self.application_name
        if not isinstance(name, str) or len(name) > MAX_APPLICATION_NAME_CHARS or not name.isascii() \
                or not name.isprintable():
            raise InvalidJob(f"application_name must be a string of at most {MAX_APPLICATION_NAME_CHARS} "
                             f"printable ASCII characters, got {name!r:.80}")
        unserved = [q for q in self.queue_limits if q not in self.queues] \
            if isinstance(self.queue_limits, Mapping) else []
        if unserved:
            raise InvalidJob(f"queue_limits names queues this pool does not serve: {unserved!r:.80} "
                             f"(queues: {list(self.queues)!r:.80})")
        self.limits  # validates the limits  # noqa: B018

    def __repr__(self) -> str:
        """No secret: the DSN's password shows as ``***``."""
        return safe_repr(self, {f.name: getattr(self, f.name) for f in fields(self)})

    def _check_queues(self) -> None:
        queues = self.queues
        if not isinstance(queues, (list, tuple)) or not queues:
            raise InvalidJob(f"queues must be a non-empty list or tuple of queue names, got {queues!r:.80}")
        for queue in queues:
            _check.queue("each of queues", queue)
        if len(set(queues)) != len(queues):
            raise InvalidJob(f"queues must not repeat, got {list(queues)!r:.80}")

    def _resolve_aliases(self) -> None:
        for old, new in (("lease_s", "lease_duration_s"), ("heartbeat_s", "heartbeat_interval_s")):
            value = getattr(self, old)
            if value is not None:
                warnings.warn(f"WorkerConfig({old}=...) is deprecated: use {new}", DeprecationWarning,
                              stacklevel=4)
                object.__setattr__(self, new, value)

    @property
    def heartbeat_every_s(self) -> float:
        """The heartbeat's period: ``heartbeat_interval_s``, or a third of the lease."""
        hb = self.heartbeat_interval_s
        return hb if hb is not None else self.lease_duration_s / 3

    @property
    def limits(self) -> Limits:
        """The pool's limits (Limits checks them: InvalidJob)."""
        return Limits(max_concurrency=self.max_concurrency, queue_limits=self.queue_limits,
                      owner_limit=self.owner_limit, owner_limits=self.owner_limits)

    @property
    def idle_in_transaction_ms(self) -> int:
        """A frozen worker's open transaction is ended by PostgreSQL after one lease.

        A live worker's fenced transaction is not: each heartbeat that renews the lease
        also resets the server's idle timer on the handler's connection (``fence_keepalive``),
        so it lives as long as the lease is renewed."""
        return max(1000, int(self.lease_duration_s * 1000))

    @property
    def pool_statement_timeout_ms(self) -> int:
        """``pool_statement_timeout_s`` in PostgreSQL's milliseconds (0: none); at least 1 when set."""
        seconds = self.pool_statement_timeout_s
        return max(1, round(seconds * 1000)) if seconds > 0 else 0


def check_pool_arguments(config: Any, handlers: Any, metrics: Any) -> WorkerConfig:
    """WorkerPool's arguments checked: ``config``, or :class:`InvalidJob` for a pool that could
    not run.  A handler that is not callable failed each of its jobs' attempts with a
    TypeError, and handlers that are not a mapping crashed the executor with the job left
    running (found by an audit of the SDK's inputs)."""
    if not isinstance(config, WorkerConfig):
        raise InvalidJob(f"config must be a WorkerConfig, got {config!r:.80}")
    if not isinstance(handlers, Mapping):
        raise InvalidJob(f"handlers must be a mapping of job kinds to callables, got {handlers!r:.80}")
    for kind, handler in handlers.items():
        if not isinstance(kind, str) or not kind:
            raise InvalidJob(f"handlers' keys must be job kinds (non-empty str), got {kind!r:.80}")
        if not callable(handler):
            raise InvalidJob(f"the handler of kind {kind!r:.80} must be callable, got {handler!r:.80}")
    if metrics is not None and not isinstance(metrics, JobsMetrics):
        raise InvalidJob(f"metrics must be None or a JobsMetrics, got {metrics!r:.80}")
    return config
