"""The worker pool's settings: one frozen, keyword-only object with units in the names."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from consumer_sdk.config import MAX_DB_SPIN_US
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.fairness import Limits
from consumer_sdk.jobs.model import BULK, INTERACTIVE, QUEUE_NAME
from consumer_sdk.jobs.retry import Backoff
from consumer_sdk.secrets import safe_repr, validate_dsn

DEFAULT_LEASE_S = 30.0
DEFAULT_POLL_INTERVAL_S = 5.0
DEFAULT_RECONCILE_INTERVAL_S = 10.0
DEFAULT_DRAIN_TIMEOUT_S = 10.0


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
      ``lease_s`` and ``heartbeat_s`` are deprecated aliases that still work.
    * ``poll_interval_s``: the safety net; losing every wake-up (NOTIFY, Kafka)
      delays work by at most this much.
    * ``reconcile_interval_s``: how often parked jobs whose wake-up was lost are
      resumed, and the queue gauges refreshed.
    * ``events_topic``: when set, terminal transitions write an event to the outbox.
    * ``drain_timeout_s``: on stop, how long running handlers may finish before
      they are asked to stop and their jobs are given back.
    * ``db_spin_us``: how long a wait for the database's answer polls the socket before
      sleeping on it (:mod:`outbox_core.spin`).  Off by default: with a pool's threads
      polling at once, they compete for the interpreter and the cores (measured: 0.74 x
      the jobs a second, 1.5 x the CPU a job, with 8 threads at 100 µs).
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
    db_spin_us: float = 0.0  # off: a pool's threads would poll against each other (README)
    lease_s: float | None = None  # deprecated alias of lease_duration_s
    heartbeat_s: float | None = None  # deprecated alias of heartbeat_interval_s

    def __post_init__(self) -> None:
        validate_dsn(self.dsn, option="WorkerConfig.dsn")
        self._resolve_aliases()
        if not self.queues or any(not isinstance(q, str) or not QUEUE_NAME.match(q) for q in self.queues):
            raise InvalidJob("queues must be a non-empty list of names of 1-64 [A-Za-z0-9_.:-]")
        if len(set(self.queues)) != len(self.queues):
            raise InvalidJob("queues must not repeat")
        if not self.lease_duration_s > 0 or not self.poll_interval_s > 0 or not self.reconcile_interval_s > 0:
            raise InvalidJob("lease_duration_s, poll_interval_s and reconcile_interval_s must be positive")
        if self.heartbeat_interval_s is not None and not 0 < self.heartbeat_interval_s <= self.lease_duration_s / 2:
            raise InvalidJob("heartbeat_interval_s must be positive and at most half of lease_duration_s")
        if self.drain_timeout_s < 0:
            raise InvalidJob("drain_timeout_s must be >= 0")
        if not 0 <= self.db_spin_us <= MAX_DB_SPIN_US:
            raise InvalidJob(f"db_spin_us must be 0 (off) to {MAX_DB_SPIN_US:,.0f}, got {self.db_spin_us!r}")
        self.limits  # validates the limits  # noqa: B018

    def __repr__(self) -> str:
        """No secret: the DSN's password shows as ``***``."""
        return safe_repr(self, {f.name: getattr(self, f.name) for f in fields(self)})

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
        try:
            return Limits(max_concurrency=self.max_concurrency, queue_limits=self.queue_limits,
                          owner_limit=self.owner_limit, owner_limits=self.owner_limits)
        except ValueError as exc:
            raise InvalidJob(str(exc)) from None

    @property
    def idle_in_transaction_ms(self) -> int:
        """A frozen worker's open transaction is ended by PostgreSQL after one lease.

        A live worker's fenced transaction is not: each heartbeat that renews the lease
        also resets the server's idle timer on the handler's connection (``fence_keepalive``),
        so it lives as long as the lease is renewed."""
        return max(1000, int(self.lease_duration_s * 1000))
