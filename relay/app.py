"""Composition root: builds the parts from settings, starts and stops them, supervises.

The relay supervises; the loop owner decides.  Each turn of :meth:`Relay.run`: heartbeat
the leases and refresh the backlog gauges when due, then one turn of the loop
(relay/loop.py: claim when due, run the pump and the replayer once) and its wait (on a
notification, a delivery report, a mark or the next due time).  Failures of the database
are waited out here, on the database's own short back-off (relay/reconnect.py: 0.5 s to
2 s, not the publish retries'), logged once per state change; signals, /healthz
(relay/probes.py) and /readyz are answered here too.

Every long-lived part has ``start()`` and an idempotent ``stop(timeout_s)``; those that
loop on the caller's thread have ``run_once()``.  Threads, and the connections each owns
(nothing else crosses between them):

* the loop (the caller of :meth:`Relay.run`): the main Store connection
  ``outbox-relay:<owner>`` (claims, leases, dead-letter moves, backlog gauges); the LISTEN
  connection ``outbox-relay-listen`` with the wake-up lock (``relay.wakeup.Wakeup``);
  the Producer (``relay.publisher``; its delivery reports run on this thread, inside
  ``poll``); the loop owner (``relay.loop.Loop``), the pump, the lease manager, the stall
  tracker, the replayer (``outbox-relay:<owner>:replay``).
* the mark threads (``relay.mark_lanes.MarkLanes``, started by ``Pump.start``), one per
  ``--mark-connections``: ``outbox-relay:<owner>:mark``, ``...:mark2``; they receive
  (tokens, rows) from the pump, split by shard, and hand back a Future per mark, applied by
  the pump in batch order on the loop's thread.
* the cleanup thread (``relay.janitor.Janitor``, when retention is set or the outbox is
  partitioned): ``outbox-relay:<owner>:cleanup``; shares nothing with the loop.
* exactly-once mode (``relay.exactly_once``): a thread per held shard with its
  transactional producer; batches and results cross through queues, and recovery marks
  on ``outbox-relay:<owner>:exactly-once`` under a lock.
* the wait watch (``relay.waits``): while the relay is held up, ``...:watch`` reads what
  its statements wait on in the database (a lock on the outbox); closed once it moves.
* the health server (``relay.http``): no connection; it calls ``health``/``ready``, which
  read a few numbers the loop writes.
* the partition watch (``relay.topic_partitions``): no connection; every 60 s, a metadata
  request of the loop's Producer per topic published to (its one call made off that thread).
* librdkafka's own threads, behind the producers.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from outbox_core.backoff import backoff_s
from relay import __version__, connections, probes, reopening, topic_partitions
from relay.app_deps import Dependencies
from relay.app_run import Running
from relay.config import (
    Settings,
    ignored_options,
    mark_connections,
    mask_dsn,
    masked_properties,
    max_message_bytes,
    producer_config,
)
from relay.connections import application_name
from relay.errors import ConfigError, FatalError, RelayError
from relay.gauges import BacklogGauges
from relay.http import HealthServer
from relay.janitor import Janitor
from relay.leases import LeaseManager
from relay.loop import Loop
from relay.metrics import RelayMetrics
from relay.publisher import Publisher
from relay.pump import Pump
from relay.pump_settle import reopens
from relay.reconnect import Reconnects
from relay.replay import Replayer
from relay.replay_store import ReplayStore
from relay.store import Store, check_not_transaction_pooled
from relay.waits import WaitWatch


class Relay(Running, Dependencies):
    """One relay replica.  ``start()`` validates and connects; ``run()`` loops until ``stop()``."""

    def __init__(self, settings: Settings, *, metrics: RelayMetrics | None = None,
                 log: Any = None, clock: Callable[[], float] = time.monotonic,
                 partitions_check_s: float = topic_partitions.CHECK_EVERY_S) -> None:
        """``partitions_check_s``: how often the partition watch looks (tests shorten it)."""
        from relay import logs

        self.settings = settings
        self.metrics = metrics or RelayMetrics()
        self.metrics.bound_topics(settings.metrics_max_topics)  # before a row is counted
        self.log = log or logs.get(owner=settings.owner)
        self.clock = clock
        self._stop = threading.Event()
        self.stopped = threading.Event()
        self.store = self._store("")
        # Marks run on connections of their own while the pump claims (relay/marker.py):
        # ":mark", then ":mark2" ... (each opened at its first mark).
        self.mark_stores = [self._store(connections.mark_role(i), reopening.CheckedStore)
                            for i in range(mark_connections(settings))]
        for mark_store in self.mark_stores:  # each series shown at 0 from the start: increase()
            self.metrics.mark_connection_losses.labels(mark_store.name)  # then sees a first loss
            self.metrics.mark_statements_cancelled.labels(mark_store.name)
        # LISTEN and the wake-up lock, on a connection of their own (relay/wakeup.py).
        self.wakeup = reopening.CheckedWakeup(settings.dsn, owner=settings.owner,
                                                on_statement=self.metrics.db_statements.inc)
        self.publisher: Publisher | None = None
        self.exactly_once: Any = None  # relay/exactly_once.py's publisher, in that mode
        # Used by the shard workers' recoveries (relay/exactly_once.py): its re-opens are checked.
        self._recovery = self._store(":exactly-once", reopening.CheckedStore) if settings.exactly_once else None
        if self._recovery is not None:  # its marks go by (id, event_id) on both layouts:
            self._recovery.mark_by_event_id()  # see TransactionalPublisher.recover
        self.pump: Pump | None = None
        self.loop: Loop | None = None  # wake, sleep and claim decisions (relay/loop.py)
        self.replayer: Replayer | None = None  # replays (relay/replay.py), built at start
        self.leases: LeaseManager | None = None
        self.http: HealthServer | None = None
        self.janitor: Janitor | None = None
        self.gauges: BacklogGauges | None = None  # relay/gauges.py, on the loop's thread
        self.partition_watch: topic_partitions.PartitionWatch | None = None  # relay/topic_partitions.py, started by start()
        self._partitions_check_s = partitions_check_s
        self.connections: connections.Checks | None = None  # checked at start and re-opened
        # What the relay's statements wait on in the database when it is held up (relay/waits.py).
        watched = connections.watched_names(lambda role: application_name(settings.owner, role),
                                            marks=mark_connections(settings))
        self.waits = WaitWatch(settings.dsn, application_name=application_name(settings.owner, ":watch"),
                               names=watched, held_up_s=self._held_up_s,
                               on_lock_wait_s=self.metrics.lock_wait.set, log=self.log, clock=clock)
        self.fatal: RelayError | None = None
        self.stop_signal: str | None = None
        self.pending = 0
        self.db_up = False
        self.broker_up = True
        self.schema_ok = False
        self.last_tick = clock()
        # When the database and the broker were last both seen coming back: /healthz
        # measures "nothing published for stuck_after_s" from the later of this and the
        # last mark, so the minutes of an outage never count against the relay.
        self.deps_up_at = self.last_tick
        self._next_shards_look = 0.0
        self._reconnects = Reconnects(cap_s=settings.backoff_max_s)  # the database's back-off
        self._cancels = Reconnects(cap_s=settings.backoff_max_s)  # a cancelled claim's (app_deps.py)
        self._db_down_event = ""

    # -- lifecycle ------------------------------------------------------------------------

    def stop(self, timeout_s: float | None = None) -> None:
        """Ask the loop to drain and exit.  Idempotent; safe from signal handlers (without
        ``timeout_s``); with it, also wait up to ``timeout_s`` for ``run`` to finish."""
        self._stop.set()
        if self.partition_watch is not None:
            self.partition_watch.stop(0.0)  # only asked: run() waits for it
        if timeout_s is not None:
            self.stopped.wait(timeout_s)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> int:
        """relay/app_run.py's run; the partition watch's thread ended with it."""
        try:
            return super().run()
        finally:
            if self.partition_watch is not None:
                self.partition_watch.stop(2 * topic_partitions.LOOKUP_TIMEOUT_S)

    def start(self) -> None:
        """Validate configuration, wait for the database, check the schema, build the producer."""
        s = self.settings
        self.metrics.build_info.info({"version": __version__})
        self.metrics.broker_up.set(1)  # until the client reports every broker down
        # The client first: librdkafka refuses a property it does not know, and a misspelt
        # secret's name ("sasl.passwd") is none that masking knows; so its value was logged
        # here in clear before the refusal.  Every property logged is one librdkafka took.
        self.publisher = Publisher(producer_config(s), on_client_error=self._client_error)
        self.log.info("relay_starting", version=__version__, dsn=mask_dsn(s.dsn),
                      bootstrap_servers=s.bootstrap_servers,
                      kafka=masked_properties(s.kafka_properties), batch_size=s.batch_size,
                      pipeline_depth=s.pipeline_depth, lease_duration_s=s.lease_duration_s)
        if s.metrics_port:
            try:
                self.http = HealthServer(host=s.metrics_host, port=s.metrics_port,
                                         registry=self.metrics.registry, health=self.health,
                                         ready=self.ready, started=self.started)
            except OSError as exc:
                raise ConfigError(f"--metrics-host/--metrics-port: cannot listen on "
                                  f"{s.metrics_host}:{s.metrics_port}: {exc.strerror or exc}") from None
            self.http.start()
            self.log.info("http_listening", host=s.metrics_host, port=self.http.port)
        # Before any session state is set: a transaction pooler would spread it (see
        # check_not_transaction_pooled); refused with one line and exit code 5.
        self._retry_db(lambda: check_not_transaction_pooled(
            s.dsn, application_name=application_name(s.owner, ":probe")))
        if self.stopping:
            return
        nshards = self._retry_db(self.store.check_schema)
        if nshards is None:
            return  # stopped while waiting
        if s.shards is not None and s.shards != nshards:  # a configuration's mistake: exit 2
            raise ConfigError(
                f"--shards {s.shards} does not match the database's {nshards} shards; "
                f"stop every relay and run `outbox-relay migrate --shards {s.shards}` to change it"
            )
        self.schema_ok = True
        if problem := self._retry_db(self.store.claim_index_problem):  # the claim works, dearer
            self.log.warning("claim_index_not_built", detail=problem)
        if not self._retry_db(lambda: self.store.take_owner_lock(s.owner)) and not self.stopping:
            # Two replicas given one --owner: the second idled without a word, holding no
            # shard (the replicas table counts the name once, so the first takes them all).
            self.log.warning("owner_in_use", owner=s.owner,
                             detail="another live relay process runs under this --owner; this one "
                                    "takes only shards nobody holds. Give each replica its own "
                                    "--owner (the default, host name and pid, is)")
        # Before the loop takes any lease: the shards it takes from other replicas would
        # otherwise wait for the new client's producer id (Publisher.warm_up).  A client
        # error that ends the relay (an untrusted certificate) stops the wait at once.
        began = self.clock()
        if self.publisher.warm_up(stopping=lambda: self.stopping):
            self.log.info("kafka_connected", took_s=round(self.clock() - began, 3))
        if self.stopping:
            return
        self.leases = LeaseManager(self.store, owner=s.owner, shards=nshards,
                                   lease_s=s.lease_duration_s, heartbeat_s=s.heartbeat_interval_s,
                                   clock=self.clock, on_lost=self._lease_lost,
                                   stalled=lambda: self.pump.stalls.as_json() if self.pump else "{}")
        pump_publisher: Any = self.publisher
        depth = s.pipeline_depth
        if s.exactly_once:  # issue 20: Kafka transactions fenced by the leases
            transactional = self._exactly_once(nshards)
            if transactional is None:
                return  # stopped while waiting for the broker
            pump_publisher = self.exactly_once = transactional
            depth = s.exactly_once_pipeline_depth
        self.pump = Pump(store=self.store, publisher=pump_publisher, leases=self.leases,
                         nshards=nshards, batch_size=s.batch_size, pipeline_depth=depth,
                         max_attempts=s.max_attempts, backoff_initial_s=s.backoff_initial_s,
                         backoff_max_s=s.backoff_max_s, metrics=self.metrics, log=self.log,
                         clock=self.clock, dead_letter_topic=s.dead_letter_topic,
                         mark_store=self.mark_stores, batch_max_bytes=s.batch_max_bytes,
                         max_message_bytes=max_message_bytes(producer_config(s)),
                         claim_interval_s=s.claim_interval_s,
                         claim_interval_max_s=max(s.claim_interval_s, s.claim_interval_max_s))
        replay_store = ReplayStore(s.dsn, application_name=application_name(s.owner, ":replay"),
                                   on_statement=self.metrics.db_statements.inc, table=s.table)
        self.replayer = Replayer(
            replay_store, self.publisher, owner=s.owner, nshards=nshards, metrics=self.metrics, log=self.log,
            clock=self.clock, lose=self.leases.lose, budget_bytes=s.batch_max_bytes)
        # Its connection re-opens on a thread of its own, never holding the loop (relay/reopening.py).
        replaying = reopening.ReopeningReplayer(self.replayer, replay_store,
                                                  name=application_name(s.owner, ":replay"), clock=self.clock)
        self.loop = Loop(pump=self.pump, wakeup=self.wakeup, leases=self.leases,
                         poll_interval_s=s.poll_interval_s, replayer=replaying,
                         on_wake=lambda reason: self.metrics.wakeups.labels(reason).inc(), clock=self.clock)
        partitioned = s.table == "outbox" and self._retry_db(self.store.is_partitioned)
        if partitioned:  # ids may repeat across partitions: marks match event ids too
            for marking in (self.store, *self.mark_stores):
                marking.mark_by_event_id()
        if s.cleanup_retention_s or partitioned:
            # A partitioned outbox always gets its coming days' partitions created.
            self.janitor = Janitor(self._store(":cleanup", reopening.CheckedStore), retention_s=s.cleanup_retention_s,
                                   batch=s.cleanup_batch, interval_s=s.cleanup_interval_s,
                                   metrics=self.metrics, partitioned=bool(partitioned), log=self.log)
        self.gauges = BacklogGauges(self.store, interval_s=s.backlog_interval_s,
                                    publish=self._backlog, log=self.log, clock=self.clock)
        # Every connection now, each within a bound, or the relay says which it cannot get
        # (a session pooler with fewer servers than it needs stalled it without a word);
        # the loop's again whenever it re-opens them (run).
        self.connections = connections.Checks(connections.relay_needs(
            lambda role: application_name(s.owner, role), store=self.store, wakeup=self.wakeup,
            mark_store=self.mark_stores[0], replay_store=replay_store, recovery_store=self._recovery,
            cleanup_store=self.janitor.store if self.janitor else None), log=self.log,
            stopping=lambda: self.stopping, optional=len(self.mark_stores) - 1)
        self._retry_db(self.connections.at_start)
        self._check_reopens()
        if self.stopping:
            return
        publisher = self.publisher
        self.partition_watch = topic_partitions.PartitionWatch(
            partitions=lambda topic: publisher.partitions_now(topic, timeout_s=topic_partitions.LOOKUP_TIMEOUT_S),
            published=lambda: topic_partitions.published_by_topic(self.metrics), metrics=self.metrics, log=self.log,
            every_s=self._partitions_check_s)
        self.partition_watch.start()
        ignored = ignored_options(s)
        if ignored:
            self.log.warning("options_ignored", options=ignored, detail="they apply with --exactly-once true")
        self.log.info("relay_started", shards=nshards, owner=s.owner)

    def _exactly_once(self, nshards: int) -> Any:
        """The transactional publisher, once the position topic is there (None: stopped while
        the broker was unreachable)."""
        from relay.exactly_once import TransactionalPublisher
        from relay.exactly_once_shard import BrokerUnreachable

        s = self.settings
        assert self.publisher is not None and self.leases is not None and self._recovery is not None
        outbox = self._retry_db(self.store.outbox_identity) or ""  # before Kafka: migration 0013
        failures = 0
        while True:  # an unreachable broker is waited for, as in the default mode
            try:
                record_limit_bytes = TransactionalPublisher.prepare(
                    producer_config(s), s.exactly_once_position_topic, nshards)
                break
            except BrokerUnreachable as exc:
                failures += 1
                if failures == 1:  # this reason, even when the producer's client said so first
                    self.log.warning("broker_unavailable", error=f"exactly-once: {exc}")
                self._broker_down()
                # The admin client behind it says only "Broker transport failure": the producer's
                # own client errors say why (rejected credentials, an untrusted certificate) and
                # end the relay.  Unread here, it waited for ever (an audit of the security paths).
                self.publisher.poll(0)
                if not self.stopping:
                    self._stop.wait(backoff_s(failures, initial_s=s.backoff_initial_s, max_s=s.backoff_max_s))
                if self.stopping:
                    return None
        if failures:
            self._broker_ok()
        return TransactionalPublisher(
            config=producer_config(s), plain=self.publisher, leases=self.leases, table=s.table,
            position_topic=s.exactly_once_position_topic,
            transactional_id_prefix=s.exactly_once_transactional_id_prefix,
            recovery_store=self._recovery, log=self.log, metrics=self.metrics,
            clock=self.clock, commit_interval_s=s.exactly_once_commit_interval_s,
            outbox=outbox, on_fatal=lambda message: self._end(ConfigError(message)), nshards=nshards,
            record_limit_bytes=record_limit_bytes)

    def _backlog(self, pending: int, oldest_age_s: float, retrying: int) -> None:
        """The backlog gauges' figures (relay/gauges.py)."""
        self.pending = pending  # /healthz: pending rows and nothing published is "stuck"
        self.metrics.pending_rows.set(pending)
        self.metrics.oldest_pending_age.set(oldest_age_s)
        self.metrics.retrying_rows.set(retrying)

    def _end(self, error: FatalError) -> None:
        """Stop the relay from a callback; ``run`` raises ``error`` when its loop ends."""
        self.fatal = error
        self.stop()

    def _held_up_s(self) -> float:
        """The wait watch's probes.held_up_s; 0 while a mark connection waits for its re-open
        (named, relay/reopening.py): the watch's look then took the server it waited for,
        behind a session pool of the relay's size, and held it while the marks waited."""
        if any(reopens(store).needs_reopen for store in self.mark_stores):
            return 0.0
        return probes.held_up_s(self)

    def _check_reopens(self) -> None:
        """After the start's check: each re-open of the connections that re-open by themselves
        (LISTEN's and the replays', on threads of their own; the mark, cleanup and
        exactly-once recovery connections, each on the thread that uses it) is checked from
        now on (relay/connections.py, relay/reopening.py)."""
        assert self.connections is not None
        self.connections.check_reopens(self.wakeup, *self.mark_stores, self.janitor and self.janitor.store,
                                       self._recovery, self.loop and self.loop.replayer)

    def _store(self, role: str, kind: type[Store] = Store) -> Store:
        """A store (connection) of this replica, named ``outbox-relay:<owner><role>``."""
        s = self.settings
        return kind(s.dsn, application_name=application_name(s.owner, role),
                    on_statement=self.metrics.db_statements.inc, table=s.table,
                    keep_published=s.keep_published)

    def _lease_lost(self, shard: int, why: str) -> None:
        self.metrics.leases_lost.inc()
        self.log.warning("lease_lost", shard=shard, reason=why)

    # -- probes ---------------------------------------------------------------------------

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``/healthz``: relay/probes.py."""
        return probes.health(self, loop_connection=application_name(self.settings.owner, ""))

    def ready(self) -> tuple[bool, dict[str, Any]]:
        ok = self.db_up and self.broker_up and self.schema_ok
        return ok, {"database": self.db_up, "broker": self.broker_up, "schema": self.schema_ok}

    def started(self) -> tuple[bool, dict[str, Any]]:
        """``/startupz``: the database was reached and the schema found (a wrong DSN, rejected
        credentials, an unmigrated schema fail it), whatever Kafka does.  A sidecar's
        startupProbe on ``/readyz`` held every application pod that started during a Kafka
        outage out of its Service, and had its relay killed after the probe's threshold."""
        return self.schema_ok, {"database": self.db_up, "schema": self.schema_ok, "broker": self.broker_up}


def install_signal_handlers(relay: Relay) -> None:
    def handler(signum: int, frame: Any) -> None:
        # No logging here: the handler may interrupt the main thread inside a log call
        # that holds the output lock, and logging again would deadlock. run() logs it.
        relay.stop_signal = signal.Signals(signum).name
        relay.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
