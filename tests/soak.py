"""Chaos soak: the whole pipeline on real services under a seeded schedule of faults (issue 9).

    python -m tests.soak --duration-s 1200 --seed 7 --relays 3 --consumers 2 --workers 2 \\
        --rate 300 --json /tmp/soak.json
    make soak SOAK_ARGS="--duration-s 1200 --seed 7"

What runs, all owned by the soak (nothing shared with other tests):

* an embedded PostgreSQL (restartable) with a fresh database migrated by ``relay.migrate``;
* a tansu broker behind a :class:`TcpProxy`: relays, consumers and the verifier reach it
  only through the proxy (it advertises the proxy's port), so cut/delay/blackhole hit
  every Kafka client;
* writers (threads of this process): transactions of 1-5 events over 1-2 keys; each
  transaction first locks its keys (``pg_advisory_xact_lock(hashtext(key))``, README
  "Ordering") and takes the keys' next seq numbers from ``soak_writer_keys`` in the same
  transaction, so a commit whose outcome is unknown cannot break a key's sequence;
* ``--relays`` replicas as real ``python -m relay run`` processes (owners r1..rN, lease
  3 s, metrics on a free port, scraped for ``outbox_relay_fenced_writes_total``);
* ``--consumers`` dedup consumers (tests/_soak_consumer.py, one group): the handler
  applies the effect (``soak_effects`` row + per-key state) in the inbox transaction;
* ``--workers`` job workers (tests/_soak_consumer.py --role worker) when
  ``consumer_sdk.jobs`` imports: consumers enqueue a job for every JOB_EVERY-th seq of a
  key in the inbox transaction; the job writes its effect fenced, result by key.

Faults come from ``random.Random(seed)`` (the plan is printed and saved): every kind once
early on, then random kinds at random gaps.  Kinds: SIGKILL (restarted after a pause)
and SIGSTOP/SIGCONT (longer than the lease / session timeout, or not) of relays,
consumers and workers; broker cut, slowed and blackholed through the proxy; database
restarted (fast shutdown) and crashed (SIGKILL); ``pg_terminate_backend`` of the
relays', consumers' or workers' connections.  Bad inputs ride along: poison rows the
relay must dead-letter, malformed messages the consumers must dead-letter, and invalid
writes the SDK or the schema must refuse.

At the end: writers stop, everything is healed, the soak waits (deadline) until the
outbox is drained and every effect applied, reads the whole topic with a verifying
consumer, stops every process with SIGTERM and checks the invariants (see
:meth:`SoakReport.failures`).  Exit code 0 only when all hold.  Logs of every process
are kept in the work directory (printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from consumer_sdk import InvalidEvent, OutboxEvent, TransactionRequired, write_event, write_events
from relay import migrate
from relay.embedded.broker import KafkaRecord, TansuBroker, create_topic, tansu_broker_behind_proxy
from relay.embedded.pg import EmbeddedPgServer, embedded_pg
from relay.embedded.procs import Proc, free_port
from relay.embedded.proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[1]
_KAFKA_LOG = logging.getLogger("tests.soak.kafka")  # librdkafka's own lines, off stderr
_KAFKA_LOG.addHandler(logging.NullHandler())
_KAFKA_LOG.propagate = False
MEMBER_SCRIPT = ROOT / "tests" / "_soak_consumer.py"

TOPIC = "soak.events"
DLQ_TOPIC = f"{TOPIC}.dlq"  # the consumers' default dead-letter topic ("{topic}.dlq")
GROUP = "soak"              # tests/_soak_consumer.py GROUP
RELAY_LEASE_S = 3.0
RELAY_HEARTBEAT_S = 1.0
SESSION_TIMEOUT_S = 6.0     # tests/_soak_consumer.py SESSION_TIMEOUT_MS
WORKER_LEASE_S = 3.0
JOB_EVERY = 10              # a job for every 10th seq of a key
POISON_PAD = 1_500_000      # above librdkafka's default message.max.bytes (1 MB)
STOP_TIMEOUT_S = 30.0

PROCESS_FAULTS = ("relay_sigkill", "relay_sigstop", "consumer_sigkill", "consumer_sigstop",
                  "worker_sigkill", "worker_sigstop")
SERVICE_FAULTS = ("broker_cut", "broker_delay", "broker_blackhole", "db_restart", "db_crash",
                  "pg_terminate")
BAD_INPUTS = ("poison_row", "bad_message", "bad_write")
#: Relative frequency of each kind after the first round.
WEIGHTS = {"relay_sigkill": 3, "relay_sigstop": 3, "consumer_sigkill": 3, "consumer_sigstop": 2,
           "worker_sigkill": 2, "worker_sigstop": 2, "broker_cut": 2, "broker_delay": 2,
           "broker_blackhole": 2, "db_restart": 1, "db_crash": 1, "pg_terminate": 3,
           "poison_row": 0.5, "bad_message": 1, "bad_write": 0.5}
TERMINATE_TARGETS = ("outbox-relay:%", "outbox-consumer:%", "outbox-jobs%", "%")

SOAK_DDL = """
CREATE TABLE soak_writer_keys (key text PRIMARY KEY, seq bigint NOT NULL DEFAULT 0);
CREATE TABLE soak_effects (event_id uuid NOT NULL, key text NOT NULL, seq bigint NOT NULL,
                           member text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE soak_keys (key text PRIMARY KEY, applied bigint NOT NULL, last_seq bigint NOT NULL,
                        regressions bigint NOT NULL);
CREATE TABLE soak_dups (event_id uuid NOT NULL, member text NOT NULL,
                        at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE soak_job_effects (job_id bigint NOT NULL, event_id uuid NOT NULL, token bigint NOT NULL,
                               member text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


# ---------------------------------------------------------------------------------------
# configuration and report


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """What to run.  Rates in events/s, times in seconds."""

    duration_s: float = 90.0
    seed: int = 1
    relays: int = 3
    consumers: int = 2
    workers: int = 2
    rate: float = 300.0
    writers: int = 4
    keys: int = 200
    partitions: int = 6
    mean_fault_gap_s: float = 5.0
    drain_timeout_s: float = 240.0
    workdir: Path | None = None
    #: None: run jobs when consumer_sdk.jobs imports; False: never.
    jobs: bool | None = None
    progress_every_s: float = 15.0


@dataclass
class SoakReport:
    """Every figure of a soak; :meth:`failures` lists the invariants that did not hold."""

    seed: int
    duration_s: float
    relays: int
    consumers: int
    workers: int
    target_rate: float
    mean_fault_gap_s: float = 5.0
    workdir: str = ""
    # load
    written: int = 0
    written_tx: int = 0
    writer_failed_tx: int = 0
    writer_unknown_outcome_tx: int = 0
    events_per_s_held: float = 0.0
    slowest_window_events_per_s: float = 0.0
    peak_backlog: int = 0
    # delivery
    published: int = 0
    kafka_records: int = 0
    delivered_unique: int = 0
    duplicates_delivered: int = 0
    duplicates_dropped: int = 0
    effects_applied: int = 0
    effect_duplicates: int = 0
    effects_unknown: int = 0
    lost: int = 0
    lost_sample: list[str] = field(default_factory=list)
    lost_detail: list[str] = field(default_factory=list)
    unapplied_detail: list[str] = field(default_factory=list)
    partition_records: dict[str, int] = field(default_factory=dict)
    watermark_mismatches: list[str] = field(default_factory=list)
    unknown_delivered: int = 0
    unknown_sample: list[str] = field(default_factory=list)
    order_violations: int = 0
    order_samples: list[str] = field(default_factory=list)
    effect_order_violations: int = 0
    keys_on_several_partitions: int = 0
    # jobs
    jobs_enabled: bool = False
    jobs_note: str = ""
    jobs_expected: int = 0
    jobs_enqueued: int = 0
    jobs_completed_once: int = 0
    jobs_not_succeeded: int = 0
    job_effects_duplicated: int = 0
    job_effects_missing: int = 0
    jobs_dead_lettered: int = 0
    jobs_leases_lost_logged: int = 0
    # fencing
    fenced_writes: int = 0
    relay_leases_lost: int = 0
    lease_lost_log_events: int = 0
    relay_order_violations_metric: int = 0
    # faults and bad inputs
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    bad_inputs_by_kind: dict[str, int] = field(default_factory=dict)
    bad_input_failures: list[str] = field(default_factory=list)
    poison_rows: int = 0
    poison_dead_lettered: int = 0
    good_rows_dead_lettered: int = 0
    bad_messages_sent: int = 0
    bad_messages_dead_lettered: int = 0
    good_events_dead_lettered: int = 0
    fault_errors: list[str] = field(default_factory=list)
    fault_log: list[str] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    unclean_stops: list[str] = field(default_factory=list)
    # timing
    drained: bool = False
    drain_s: float = 0.0
    wall_s: float = 0.0

    @property
    def faults_total(self) -> int:
        return sum(self.faults_by_kind.values())

    def failures(self) -> list[str]:
        """The invariants that did not hold (empty: the soak passed)."""
        bad: list[str] = []

        def check(ok: bool, text: str) -> None:
            if not ok:
                bad.append(text)

        check(self.written > 0, "nothing was written")
        check(self.drained, f"not drained within the deadline (after {self.drain_s:.0f} s)")
        check(self.lost == 0, f"lost = {self.lost} (see lost.txt; e.g. {self.lost_detail[:3]})")
        check(self.unknown_delivered == 0, f"{self.unknown_delivered} delivered events are not in the outbox: "
                                           f"{self.unknown_sample[:3]}")
        check(self.published == self.written, f"published {self.published} != written {self.written}")
        check(self.effects_applied == self.written,
              f"effects applied {self.effects_applied} != written {self.written} {self.unapplied_detail}")
        check(self.effect_duplicates == 0, f"{self.effect_duplicates} events applied more than once")
        check(self.effects_unknown == 0, f"{self.effects_unknown} effects of events never written")
        check(self.order_violations == 0, f"{self.order_violations} per-key order violations in Kafka "
                                          f"(first deliveries): {self.order_samples[:5]}")
        check(self.effect_order_violations == 0,
              f"{self.effect_order_violations} effects applied out of their key's order")
        check(self.relay_order_violations_metric == 0,
              f"the relays counted {self.relay_order_violations_metric} order violations "
              f"(outbox_relay_order_violations_total)")
        check(self.keys_on_several_partitions == 0,
              f"{self.keys_on_several_partitions} keys were delivered to more than one partition")
        check(self.good_rows_dead_lettered == 0, f"{self.good_rows_dead_lettered} good rows dead-lettered by the relay")
        check(self.poison_dead_lettered == self.poison_rows,
              f"{self.poison_dead_lettered} of {self.poison_rows} poison rows dead-lettered by the relay")
        check(self.good_events_dead_lettered == 0,
              f"{self.good_events_dead_lettered} good events dead-lettered by the consumers")
        check(self.bad_messages_dead_lettered == self.bad_messages_sent,
              f"{self.bad_messages_dead_lettered} of {self.bad_messages_sent} bad messages dead-lettered")
        check(not self.bad_input_failures, f"bad inputs not refused: {self.bad_input_failures[:5]}")
        if self.jobs_enabled:
            check(self.jobs_enqueued == self.jobs_expected,
                  f"jobs enqueued {self.jobs_enqueued} != expected {self.jobs_expected}")
            check(self.jobs_completed_once == self.jobs_expected,
                  f"jobs completed once {self.jobs_completed_once} != expected {self.jobs_expected} "
                  f"(not succeeded {self.jobs_not_succeeded}, effect duplicated {self.job_effects_duplicated}, "
                  f"effect missing {self.job_effects_missing}, dead {self.jobs_dead_lettered})")
        check(not self.unexpected_exits, f"processes exited on their own: {self.unexpected_exits[:5]}")
        check(not self.unclean_stops, f"processes did not stop cleanly on SIGTERM: {self.unclean_stops[:5]}")
        check(not self.fault_errors, f"fault injection errors: {self.fault_errors[:5]}")
        return bad

    @property
    def ok(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["faults_total"] = self.faults_total
        data["failures"] = self.failures()
        data["ok"] = not data["failures"]
        return data

    def render(self) -> str:
        """The human report."""
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults_by_kind.items())) or "none"
        bad_inputs = ", ".join(f"{k} {v}" for k, v in sorted(self.bad_inputs_by_kind.items())) or "none"
        jobs = (f"{self.jobs_completed_once} of {self.jobs_expected} completed exactly once "
                f"(enqueued {self.jobs_enqueued}, not succeeded {self.jobs_not_succeeded}, effect duplicated "
                f"{self.job_effects_duplicated}, effect missing {self.job_effects_missing}, dead-lettered "
                f"{self.jobs_dead_lettered}, worker lease_lost log events {self.jobs_leases_lost_logged})"
                if self.jobs_enabled else f"not run ({self.jobs_note})")
        failures = self.failures()
        lines = [
            "=" * 78,
            f"chaos soak  seed={self.seed}  duration={self.duration_s:.0f}s  relays={self.relays}  "
            f"consumers={self.consumers}  workers={self.workers if self.jobs_enabled else 0}",
            "-" * 78,
            f"events written            {self.written}  ({self.written_tx} transactions; "
            f"{self.writer_failed_tx} failed and {self.writer_unknown_outcome_tx} with unknown outcome, retried)",
            f"load held                 {self.events_per_s_held:.1f} events/s (target {self.target_rate:g}; "
            f"slowest 10 s window {self.slowest_window_events_per_s:.1f}/s; peak backlog {self.peak_backlog})",
            f"published                 {self.published}",
            f"in Kafka                  {self.kafka_records} records, {self.delivered_unique} unique events",
            f"duplicates delivered      {self.duplicates_delivered} (copies in Kafka)",
            f"duplicates dropped        {self.duplicates_dropped} (by the consumers' inbox)",
            f"effects applied           {self.effects_applied}  (must equal written; "
            f"applied twice {self.effect_duplicates}, unknown {self.effects_unknown})",
            f"LOST                      {self.lost}  (must be 0)",
            f"order violations per key  {self.order_violations} in Kafka first deliveries, "
            f"{self.effect_order_violations} in effects (must be 0)",
            f"jobs                      {jobs}",
            f"fenced writes rejected    {self.fenced_writes} relay writes "
            f"(outbox_relay_fenced_writes_total; leases lost {self.relay_leases_lost}, "
            f"lease_lost log events {self.lease_lost_log_events})",
            f"faults injected           {self.faults_total}: {faults}",
            f"bad inputs tried          {sum(self.bad_inputs_by_kind.values())}: {bad_inputs}",
            f"  poison rows             {self.poison_dead_lettered} of {self.poison_rows} dead-lettered by the relay "
            f"(good rows dead-lettered {self.good_rows_dead_lettered})",
            f"  malformed messages      {self.bad_messages_dead_lettered} of {self.bad_messages_sent} "
            f"dead-lettered by the consumers (good events dead-lettered {self.good_events_dead_lettered})",
            f"process exits on their own {len(self.unexpected_exits)}; unclean stops {len(self.unclean_stops)}",
            *([f"broker watermarks         {len(self.watermark_mismatches)} partitions whose high watermark "
               f"disagreed with what was read: {self.watermark_mismatches[:3]}"] if self.watermark_mismatches else []),
            f"drained                   {self.drained} after {self.drain_s:.1f} s; wall time {self.wall_s:.0f} s",
            f"logs                      {self.workdir}",
            f"replay                    python -m tests.soak --duration-s {self.duration_s:g} --seed {self.seed} "
            f"--relays {self.relays} --consumers {self.consumers} --workers {self.workers} "
            f"--rate {self.target_rate:g} --mean-fault-gap-s {self.mean_fault_gap_s:g}",
            "-" * 78,
            "RESULT: PASS" if not failures else "RESULT: FAIL\n  - " + "\n  - ".join(failures),
            "=" * 78,
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# the fault plan (pure: seed in, list of faults out)


@dataclass(frozen=True)
class Fault:
    """One planned fault: at ``at_s`` after the start, on ``target``, lasting ``hold_s``."""

    at_s: float
    kind: str
    target: str
    hold_s: float = 0.0
    param: float = 0.0

    def describe(self) -> str:
        extra = f" param={self.param:g}" if self.param else ""
        return f"t={self.at_s:7.2f}s {self.kind:<17} {self.target:<18} hold={self.hold_s:5.2f}s{extra}"


def plan_faults(*, seed: int, duration_s: float, relays: int, consumers: int, workers: int,
                mean_gap_s: float) -> list[Fault]:
    """Every available kind once (shuffled, spread over the first three quarters), then
    random kinds at exponential gaps.  A target (a process, the proxy, the database) has
    one fault at a time; every fault ends before ``duration_s``."""
    rng = random.Random(seed)
    members = {"relay": [f"r{i}" for i in range(1, relays + 1)],
               "consumer": [f"c{i}" for i in range(1, consumers + 1)],
               "worker": [f"w{i}" for i in range(1, workers + 1)]}
    kinds = [k for k in (*PROCESS_FAULTS, *SERVICE_FAULTS, *BAD_INPUTS)
             if not k.endswith(("_sigkill", "_sigstop")) or members[k.split("_")[0]]]
    busy: dict[str, float] = {}
    end = duration_s - 1.0
    faults: list[Fault] = []

    def add(kind: str, at: float, first: bool) -> None:
        fault = _draw(rng, kind, at, first, members)
        while busy.get(fault.target, 0.0) > fault.at_s:  # the target is still faulted: later
            fault = _draw(rng, kind, busy[fault.target] + 0.5, first, members)
        if fault.at_s + fault.hold_s <= end:
            settle = 1.0 if fault.kind.endswith("_sigkill") else 0.5
            busy[fault.target] = fault.at_s + fault.hold_s + settle
            faults.append(fault)

    first_round = list(kinds)
    rng.shuffle(first_round)
    start = min(5.0, duration_s * 0.05)
    spacing = min(mean_gap_s, max(0.5, (duration_s * 0.75 - start) / len(first_round)))
    t = start
    for kind in first_round:
        add(kind, t, first=True)
        t += spacing
    weights = [WEIGHTS[k] for k in kinds]
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t >= end:
            break
        add(rng.choices(kinds, weights)[0], t, first=False)
    return sorted(faults, key=lambda f: f.at_s)


def _draw(rng: random.Random, kind: str, at: float, first: bool, members: dict[str, list[str]]) -> Fault:
    """One fault of ``kind`` at ``at``; in the first round, pauses outlast the lease/session."""
    u = rng.uniform
    if kind.endswith(("_sigkill", "_sigstop")):
        role = kind.split("_")[0]
        target = rng.choice(members[role])
        if kind.endswith("_sigkill"):
            return Fault(at, kind, target, u(0.5, 4.0))
        limit = SESSION_TIMEOUT_S if role == "consumer" else (RELAY_LEASE_S if role == "relay" else WORKER_LEASE_S)
        hold = u(limit + 1.0, limit * 2 + 1.0) if first or rng.random() < 0.6 else u(0.5, limit)
        return Fault(at, kind, target, hold)
    if kind == "broker_cut":
        return Fault(at, kind, "proxy", u(1.0, 6.0))
    if kind == "broker_delay":
        return Fault(at, kind, "proxy", u(2.0, 8.0), param=round(u(50, 400)))
    if kind == "broker_blackhole":
        return Fault(at, kind, "proxy", u(2.0, 8.0))
    if kind == "db_restart":
        return Fault(at, kind, "db", u(0.2, 3.0))
    if kind == "db_crash":
        return Fault(at, kind, "db", u(0.2, 2.0))
    if kind == "pg_terminate":
        return Fault(at, kind, rng.choice(TERMINATE_TARGETS))
    return Fault(at, kind, kind)  # bad inputs: instantaneous, one at a time per kind


# ---------------------------------------------------------------------------------------
# processes


class Member:
    """A relay, consumer or worker process under a name that survives restarts (r1, c1, w1).

    ``expected_down`` is set before the soak kills it, so the monitor can tell a crash of
    its own (an unexpected exit, restarted and reported) from a fault.
    """

    def __init__(self, name: str, role: str, build: Callable[[Member], tuple[list[str], dict[str, str]]],
                 log_path: Path) -> None:
        self.name, self.role, self._build, self.log_path = name, role, build, log_path
        self.lock = threading.RLock()
        self.proc: Proc | None = None
        self.incarnation = 0
        self.expected_down = True
        self.frozen = False
        self.port: int | None = None  # relays: metrics port of the current incarnation
        self.scrapes: dict[int, dict[str, float]] = {}
        self.unexpected_exits: list[str] = []

    def start(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.alive:
                return
            if self.proc is not None:
                self.proc.close()
            self.incarnation += 1
            self.port = free_port() if self.role == "relay" else None
            cmd, env = self._build(self)
            self.proc = Proc(cmd, env=env, log_path=self.log_path, cwd=ROOT, name=self.name)
            self.expected_down = False
            self.frozen = False

    def kill(self) -> None:
        """SIGKILL (the process tree); scraped first so its counters are not lost."""
        with self.lock:
            self.scrape()
            self.expected_down = True
            if self.proc is not None:
                self.proc.close()

    def freeze(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.alive:
                self.scrape()
                self.proc.sigstop()
                self.frozen = True

    def thaw(self) -> None:
        with self.lock:
            if self.proc is not None and self.frozen:
                self.proc.sigcont()
            self.frozen = False

    def check(self) -> str | None:
        """Restart a process that exited on its own; returns a description of the exit."""
        with self.lock:
            if self.proc is None or self.expected_down or self.proc.alive:
                return None
            text = (f"{self.name} (incarnation {self.incarnation}) exited with {self.proc.returncode}: "
                    f"{self.proc.log_tail(600)!r}")
            self.unexpected_exits.append(text)
            self.start()
            return text

    def scrape(self, timeout_s: float = 0.5) -> None:
        """Read the relay's counters (kept per incarnation: a restart starts from zero)."""
        if self.port is None or self.proc is None or not self.proc.alive or self.frozen:
            return
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout_s) as resp:
                text = resp.read().decode()
        except OSError:
            return
        self.scrapes[self.incarnation] = parse_metrics(text)

    def counter(self, name: str) -> float:
        return sum(values.get(name, 0.0) for values in self.scrapes.values())

    def stop(self) -> int | None:
        """SIGTERM (after SIGCONT) and wait; the exit code, None when it had to be killed."""
        with self.lock:
            proc = self.proc
            if proc is None or not proc.alive:
                return proc.returncode if proc is not None else 0
            self.scrape()
            self.expected_down = True
            if self.frozen:
                proc.sigcont()
                self.frozen = False
            proc.sigterm()
        try:
            return proc.wait(STOP_TIMEOUT_S)
        except TimeoutError:
            return None
        finally:
            proc.close()

    def close(self) -> None:
        with self.lock:
            self.expected_down = True
            if self.proc is not None:
                self.proc.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: the sum of every sample of each metric name."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", line)
        if match:
            try:
                values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
            except ValueError:
                pass
    return values


# ---------------------------------------------------------------------------------------
# writers


class Writers:
    """Threads committing transactions of 1-5 events over 1-2 keys at ``rate`` events/s in all."""

    def __init__(self, dsn: str, *, keys: Sequence[str], rate: float, threads: int, seed: int) -> None:
        self.dsn, self.keys, self.rate = dsn, list(keys), rate
        self._seed = seed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0.0
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"soak-writer-{i}", daemon=True)
                         for i in range(threads)]
        self.events = 0
        self.transactions = 0
        self.failed = 0
        self.unknown = 0
        self.windows: Counter[int] = Counter()  # events committed per 10 s window
        self.started_at = 0.0
        self.stopped_at = 0.0

    def start(self) -> None:
        self.started_at = time.monotonic()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        self.stopped_at = time.monotonic()

    def _pace(self, n: int) -> None:
        """Reserve ``n`` events' worth of the rate; an outage is not made up with a burst."""
        with self._lock:
            now = time.monotonic()
            at = max(now, self._next)
            self._next = at + n / self.rate
        if at > now:
            self._stop.wait(at - now)

    def _run(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        conn: psycopg.Connection[Any] | None = None
        failures = 0
        while not self._stop.is_set():
            n = rng.randint(1, 5)
            keys = sorted(rng.sample(self.keys, 2 if n > 1 and rng.random() < 0.3 else 1))
            self._pace(n)
            committing = False
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=3,
                                           application_name=f"soak-writer-{index}")
                with conn.transaction():
                    events = self._events(conn, rng, keys, n, index)
                    write_events(conn, events)
                    committing = True
                with self._lock:
                    self.events += n
                    self.transactions += 1
                    self.windows[int((time.monotonic() - self.started_at) // 10)] += n
                failures = 0
            except psycopg.Error:
                with self._lock:
                    if committing:
                        self.unknown += 1  # the commit itself failed: it may or may not have happened
                    else:
                        self.failed += 1
                if conn is not None:
                    conn.close()
                conn = None
                failures += 1
                self._stop.wait(min(1.0, 0.05 * 2 ** min(failures, 5)))
        if conn is not None:
            conn.close()

    def _events(self, conn: psycopg.Connection[Any], rng: random.Random, keys: list[str], n: int,
                index: int) -> list[OutboxEvent]:
        # The keys' locks first, in one statement and a fixed (hash) order: no deadlock.
        conn.execute("SELECT pg_advisory_xact_lock(h) FROM (SELECT DISTINCT hashtext(k) AS h "
                     "FROM unnest(%s::text[]) AS k ORDER BY h) AS locks", (keys,))
        counts = [n] if len(keys) == 1 else [(first := rng.randint(1, n - 1)), n - first]
        events: list[OutboxEvent] = []
        for key, count in zip(keys, counts, strict=True):
            row = conn.execute("UPDATE soak_writer_keys SET seq = seq + %s WHERE key = %s RETURNING seq",
                               (count, key)).fetchone()
            assert row is not None
            for seq in range(int(row[0]) - count + 1, int(row[0]) + 1):
                events.append(OutboxEvent(topic=TOPIC, key=key, payload={"key": key, "seq": seq, "w": index}))
        return events

    def slowest_window(self) -> float:
        """Events/s of the slowest complete 10 s window."""
        full = int((self.stopped_at - self.started_at) // 10)
        return min((self.windows.get(i, 0) / 10.0 for i in range(full)), default=0.0)


# ---------------------------------------------------------------------------------------
# the soak


class Soak:
    """Owns the services, the processes, the writers and the chaos; see the module docstring."""

    def __init__(self, config: SoakConfig, log: Callable[[str], None] = print) -> None:
        self.cfg = config
        self._say = log
        self.t0 = time.monotonic()
        self.workdir = config.workdir or Path(tempfile.mkdtemp(prefix=f"soak-{config.seed}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pg: EmbeddedPgServer | None = None
        self.broker: TansuBroker | None = None
        self.proxy: TcpProxy | None = None
        self.dsn = ""
        self.bootstrap = ""
        self.members: dict[str, Member] = {}
        self.writers: Writers | None = None
        self.jobs_enabled = False
        self.jobs_note = ""
        self.report = SoakReport(seed=config.seed, duration_s=config.duration_s, relays=config.relays,
                                 consumers=config.consumers, workers=config.workers,
                                 target_rate=config.rate, mean_fault_gap_s=config.mean_fault_gap_s,
                                 workdir=str(self.workdir))
        self.faults: Counter[str] = Counter()
        self.bad_inputs: Counter[str] = Counter()
        self.fault_log: list[str] = []
        self._abort = threading.Event()
        self._fault_threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.poison_ids: list[str] = []
        self.bad_messages: dict[str, str] = {}  # soak_bad id -> expected dlq_reason
        self.peak_backlog = 0
        self._applied: set[str] = set()

    def say(self, text: str) -> None:
        self._say(f"[soak {time.monotonic() - self.t0:7.1f}s] {text}")

    # -- set-up ---------------------------------------------------------------------------

    def setup(self) -> None:
        self.pg = embedded_pg()
        self.dsn = self.pg.create_database("soak")
        with psycopg.connect(self.pg.admin_dsn, autocommit=True) as conn:
            # The embedded server runs with synchronous_commit=off (fast tests): a crash of
            # PostgreSQL then forgets commits it already acknowledged, whose rows a relay
            # may have published already (events of transactions that no longer exist).
            # That is the server's durability setting, not the relay's, so the soak asks
            # for durable commits: db_crash must lose nothing.
            conn.execute("ALTER DATABASE soak SET synchronous_commit = on")
        migrate.apply(self.dsn)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(SOAK_DDL)
            conn.execute("INSERT INTO soak_writer_keys (key) SELECT unnest(%s::text[])", (self.key_names(),))
        self.broker, self.proxy = tansu_broker_behind_proxy()
        self.bootstrap = self.broker.bootstrap
        create_topic(self.bootstrap, TOPIC, partitions=self.cfg.partitions)
        create_topic(self.bootstrap, DLQ_TOPIC, partitions=1)
        self.jobs_enabled, self.jobs_note = self._jobs_available()
        self.say(f"PostgreSQL {self.pg.port}, tansu {self.broker.direct_bootstrap} via proxy {self.bootstrap}, "
                 f"jobs {'on' if self.jobs_enabled else 'off: ' + self.jobs_note}; logs in {self.workdir}")
        for i in range(1, self.cfg.relays + 1):
            self._member(f"r{i}", "relay", self._relay_cmd)
        for i in range(1, self.cfg.consumers + 1):
            self._member(f"c{i}", "consumer", self._consumer_cmd)
        if self.jobs_enabled:
            for i in range(1, self.cfg.workers + 1):
                self._member(f"w{i}", "worker", self._worker_cmd)
        for m in self.members.values():
            m.start()
        for m in self.members.values():
            assert m.proc is not None
            marker = {"relay": "relay_started", "consumer": "consumer_started", "worker": "soak_member_started"}
            m.proc.wait_for_log(marker[m.role], timeout_s=60)

    def key_names(self) -> list[str]:
        return [f"k{i:04d}" for i in range(self.cfg.keys)]

    def _jobs_available(self) -> tuple[bool, str]:
        if self.cfg.jobs is False or self.cfg.workers <= 0:
            return False, "disabled (--workers 0)"
        try:
            from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - the jobs package may be unfinished
            return False, f"consumer_sdk.jobs does not import: {type(exc).__name__}: {exc}"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass('jobs')").fetchone() == (None,):
                return False, "no jobs table (sql/migrations/0005_jobs.sql missing)"
        return True, ""

    def _member(self, name: str, role: str, build: Callable[[Member], tuple[list[str], dict[str, str]]]) -> None:
        self.members[name] = Member(name, role, build, self.workdir / f"{name}.log")

    def _relay_cmd(self, m: Member) -> tuple[list[str], dict[str, str]]:
        env = {
            "OUTBOX_RELAY_DSN": self.dsn, "OUTBOX_RELAY_BOOTSTRAP_SERVERS": self.bootstrap,
            "OUTBOX_RELAY_OWNER": m.name, "OUTBOX_RELAY_METRICS_PORT": str(m.port),
            "OUTBOX_RELAY_METRICS_HOST": "127.0.0.1", "OUTBOX_RELAY_LOG_FORMAT": "json",
            "OUTBOX_RELAY_LOG_LEVEL": "info", "OUTBOX_RELAY_POLL_INTERVAL_S": "0.5",
            "OUTBOX_RELAY_LEASE_DURATION_S": str(RELAY_LEASE_S),
            "OUTBOX_RELAY_HEARTBEAT_INTERVAL_S": str(RELAY_HEARTBEAT_S),
            "OUTBOX_RELAY_BATCH_SIZE": "200", "OUTBOX_RELAY_PIPELINE_DEPTH": "4",
            "OUTBOX_RELAY_BACKOFF_MAX_S": "2", "OUTBOX_RELAY_DRAIN_TIMEOUT_S": "5",
            "OUTBOX_RELAY_KAFKA_RECONNECT_BACKOFF_MAX_MS": "1000",
        }
        return [sys.executable, "-m", "relay", "run"], env

    def _consumer_cmd(self, m: Member) -> tuple[list[str], dict[str, str]]:
        cmd = [sys.executable, str(MEMBER_SCRIPT), "--role", "consumer", "--dsn", self.dsn,
               "--bootstrap", self.bootstrap, "--topic", TOPIC, "--member", m.name,
               "--job-every", str(JOB_EVERY if self.jobs_enabled else 0)]
        return cmd, {"PYTHONPATH": str(ROOT)}

    def _worker_cmd(self, m: Member) -> tuple[list[str], dict[str, str]]:
        cmd = [sys.executable, str(MEMBER_SCRIPT), "--role", "worker", "--dsn", self.dsn, "--member", m.name,
               "--lease-s", str(WORKER_LEASE_S)]
        return cmd, {"PYTHONPATH": str(ROOT)}

    # -- the run --------------------------------------------------------------------------

    def run(self) -> SoakReport:
        cfg = self.cfg
        plan = plan_faults(seed=cfg.seed, duration_s=cfg.duration_s, relays=cfg.relays,
                           consumers=cfg.consumers, workers=cfg.workers if self.jobs_enabled else 0,
                           mean_gap_s=cfg.mean_fault_gap_s)
        (self.workdir / "plan.txt").write_text("\n".join(f.describe() for f in plan) + "\n")
        self.say(f"{len(plan)} faults planned (seed {cfg.seed}): {dict(Counter(f.kind for f in plan))}")
        self.writers = Writers(self.dsn, keys=self.key_names(), rate=cfg.rate, threads=cfg.writers, seed=cfg.seed)
        start = time.monotonic()
        self.writers.start()
        chaos = threading.Thread(target=self._chaos, args=(plan, start), name="soak-chaos", daemon=True)
        chaos.start()
        end = start + cfg.duration_s
        next_progress = start + cfg.progress_every_s
        next_sample = start + 5.0
        while (now := time.monotonic()) < end and not self._abort.is_set():
            self._watch()
            if now >= next_progress:
                next_progress += cfg.progress_every_s
                next_sample = now + 5.0
                self._progress("running")
            elif now >= next_sample:
                next_sample = now + 5.0
                self._status()  # samples the backlog
            self._abort.wait(min(1.0, max(0.0, end - now)))
        chaos.join()
        for t in self._fault_threads:
            t.join(60)
        self.writers.stop()
        self.say(f"writing stopped: {self.writers.events} events in {self.writers.transactions} transactions")
        self._heal_all()
        self._drain()
        self._verify()
        self._stop_all()
        self._finish_report()
        return self.report

    def abort(self) -> None:
        self._abort.set()

    def _progress(self, phase: str) -> None:
        st = self._status()
        written = self.writers.events if self.writers is not None else 0
        faults = sum(self.faults.values())
        if st is None:
            self.say(f"{phase}: committed {written}, database unreachable, faults {faults}")
            return
        self.say(f"{phase}: committed {written}, pending {st['pending']}, effects {st['effects']}, "
                 f"jobs open {st['jobs_open']}, faults {faults}, bad inputs {sum(self.bad_inputs.values())}")

    def _status(self) -> dict[str, int] | None:
        """Counts for progress and draining; None while the database is unreachable."""
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute(
                    "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL AND key LIKE 'k%%'),"
                    " (SELECT count(*) FROM outbox WHERE key LIKE 'k%%'),"
                    " (SELECT count(*) FROM soak_effects),"
                    " (SELECT count(*) FROM outbox WHERE key LIKE 'poison-%%')").fetchone()
                jobs_open = 0
                if self.jobs_enabled:
                    jobs_open = _scalar(conn, "SELECT count(*) FROM jobs WHERE queue = 'soak' "
                                              "AND status NOT IN ('succeeded', 'failed', 'cancelled')")
        except psycopg.Error:
            return None
        assert row is not None
        self.peak_backlog = max(self.peak_backlog, int(row[0]))
        return {"pending": int(row[0]), "written": int(row[1]), "effects": int(row[2]),
                "poison_left": int(row[3]), "jobs_open": int(jobs_open)}

    def _watch(self) -> None:
        """Restart processes that died on their own; scrape the relays."""
        for m in self.members.values():
            exit_text = m.check()
            if exit_text:
                self.say(f"UNEXPECTED EXIT: {exit_text}")
            if m.role == "relay":
                m.scrape(timeout_s=0.3)

    # -- chaos ----------------------------------------------------------------------------

    def _chaos(self, plan: list[Fault], start: float) -> None:
        for fault in plan:
            if self._abort.wait(max(0.0, start + fault.at_s - time.monotonic())):
                return
            t = threading.Thread(target=self._inject, args=(fault,), name=f"fault-{fault.kind}", daemon=True)
            self._fault_threads.append(t)
            t.start()

    def _inject(self, fault: Fault) -> None:
        at = time.monotonic() - self.t0
        try:
            getattr(self, f"_do_{fault.kind}")(fault)
            with self._lock:
                if fault.kind not in BAD_INPUTS:  # bad inputs are counted by variant where made
                    self.faults[fault.kind] += 1
                self.fault_log.append(f"{at:8.2f}s  {fault.describe()}")
        except Exception as exc:  # noqa: BLE001 - reported, and fails the soak
            text = f"{fault.describe()}: {type(exc).__name__}: {exc}"
            with self._lock:
                self.report.fault_errors.append(text)
            self.say(f"FAULT ERROR {text}")

    def _hold(self, seconds: float) -> None:
        self._abort.wait(seconds)  # part of the schedule, cut short on abort

    def _kill_and_restart(self, f: Fault) -> None:
        m = self.members[f.target]
        m.kill()
        self._hold(f.hold_s)
        m.start()

    def _stop_and_continue(self, f: Fault) -> None:
        m = self.members[f.target]
        m.freeze()
        self._hold(f.hold_s)
        m.thaw()

    _do_relay_sigkill = _do_consumer_sigkill = _do_worker_sigkill = _kill_and_restart
    _do_relay_sigstop = _do_consumer_sigstop = _do_worker_sigstop = _stop_and_continue

    def _proxy_fault(self, f: Fault, apply: Callable[[], None]) -> None:
        assert self.proxy is not None
        apply()
        try:
            self._hold(f.hold_s)
        finally:
            self.proxy.restore()

    def _do_broker_cut(self, f: Fault) -> None:
        assert self.proxy is not None
        self._proxy_fault(f, self.proxy.cut)

    def _do_broker_delay(self, f: Fault) -> None:
        assert self.proxy is not None
        self._proxy_fault(f, lambda: self.proxy.set_delay(f.param))  # type: ignore[union-attr]

    def _do_broker_blackhole(self, f: Fault) -> None:
        assert self.proxy is not None
        self._proxy_fault(f, self.proxy.blackhole)

    def _do_db_restart(self, f: Fault) -> None:
        assert self.pg is not None
        self.pg.stop()
        try:
            self._hold(f.hold_s)
        finally:
            self.pg.start()

    def _do_db_crash(self, f: Fault) -> None:
        assert self.pg is not None
        self.pg.kill()
        try:
            self._hold(f.hold_s)
        finally:
            self.pg.start()

    def _do_pg_terminate(self, f: Fault) -> None:
        assert self.pg is not None
        deadline = time.monotonic() + 15
        while True:  # a database fault may be under way: retry briefly
            try:
                with psycopg.connect(self.pg.admin_dsn, autocommit=True, connect_timeout=3) as conn:
                    rows = conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'soak' "
                        "AND application_name LIKE %s AND application_name NOT LIKE 'soak-%%' "
                        "AND pid <> pg_backend_pid()", (f.target,)).fetchall()
                self.say(f"pg_terminate_backend {f.target!r}: {len(rows)} connections")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                self._hold(0.5)

    def _with_db(self, call: Callable[[psycopg.Connection[Any]], Any], timeout_s: float = 20.0) -> Any:
        """Run ``call`` on a fresh connection, retrying while a database fault lasts."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=3,
                                     application_name="soak-bad-input") as conn:
                    return call(conn)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                self._hold(0.5)

    def _do_poison_row(self, f: Fault) -> None:
        """A row the relay can never publish: too large, or a header that is not a string."""
        n = len(self.poison_ids)
        too_large = n % 2 == 0
        key = f"poison-{n}"

        def write(conn: psycopg.Connection[Any]) -> str:
            with conn.transaction():
                if too_large:
                    return str(write_event(conn, topic=TOPIC, key=key, payload={"key": key, "pad": "x" * POISON_PAD}))
                row = conn.execute("INSERT INTO outbox (topic, key, payload, headers) "
                                   "VALUES (%s, %s, %s, '{\"retries\": 3}') RETURNING event_id",
                                   (TOPIC, key, json.dumps({"key": key}))).fetchone()
                assert row is not None
                return str(row[0])

        event_id = self._with_db(write)
        with self._lock:
            self.poison_ids.append(event_id)
            self.bad_inputs["poison_row:" + ("too_large" if too_large else "bad_header")] += 1

    def _do_bad_message(self, f: Fault) -> None:
        """Messages produced straight to the topic that the consumers must dead-letter."""
        variants = [("no_event_id", "invalid_event_id"), ("event_id_not_uuid", "invalid_event_id"),
                    ("event_id_reused_other_body", "payload_mismatch")]
        producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                             "message.timeout.ms": 60000, "reconnect.backoff.max.ms": 1000,
                             "logger": _KAFKA_LOG})
        sent: list[tuple[str, str, str]] = []
        reports: list[Any] = []
        for variant, reason in variants:
            bad_id = uuid.uuid4().hex
            headers: list[tuple[str, str | bytes | None]] = [("soak_bad", bad_id.encode())]
            if variant == "event_id_not_uuid":
                headers.append(("event_id", b"not-a-uuid"))
            elif variant == "event_id_reused_other_body":
                reused = self._with_db(lambda c: c.execute(
                    "SELECT event_id FROM soak_effects LIMIT 1 OFFSET floor(random() * 50)").fetchone())
                if reused is None:
                    continue
                headers.append(("event_id", str(reused[0]).encode()))
            producer.produce(TOPIC, key=f"bad-{bad_id[:8]}".encode(),
                             value=json.dumps({"key": "bad", "seq": -1, "bad": bad_id}).encode(),
                             headers=headers, on_delivery=lambda err, _msg: reports.append(err))
            sent.append((bad_id, reason, variant))
        producer.flush(90)
        if len(reports) != len(sent) or any(err is not None for err in reports):
            raise RuntimeError(f"bad messages not acknowledged: {reports}")
        with self._lock:
            for bad_id, reason, variant in sent:
                self.bad_messages[bad_id] = reason
                self.bad_inputs["bad_message:" + variant] += 1

    def _do_bad_write(self, f: Fault) -> None:
        """Writes the SDK or the schema must refuse; any that goes through is a failure."""
        attempts: list[tuple[str, type[BaseException], Callable[[psycopg.Connection[Any]], Any]]] = [
            ("sdk_invalid_topic", InvalidEvent,
             lambda c: write_event(c, topic="bad topic!", key="bad", payload={})),
            ("sdk_reserved_header", InvalidEvent,
             lambda c: write_event(c, topic=TOPIC, key="bad", payload={}, headers={"event_id": "x"})),
            ("sql_invalid_topic", psycopg.errors.CheckViolation,
             lambda c: c.execute("INSERT INTO outbox (topic, key, payload) VALUES ('bad topic!', 'bad', '{}')")),
            ("sql_headers_not_object", psycopg.errors.CheckViolation,
             lambda c: c.execute("INSERT INTO outbox (topic, key, payload, headers) VALUES (%s, 'bad', '{}', '[1]')",
                                 (TOPIC,))),
            ("sql_two_payloads", psycopg.errors.CheckViolation,
             lambda c: c.execute("INSERT INTO outbox (topic, key, payload, payload_bytes) "
                                 "VALUES (%s, 'bad', '{}', '\\x00')", (TOPIC,))),
            ("sql_invalid_json", psycopg.errors.InvalidTextRepresentation,
             lambda c: c.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'bad', 'not json')",
                                 (TOPIC,))),
            ("sdk_reused_event_id", psycopg.errors.UniqueViolation,
             lambda c: write_event(c, topic=TOPIC, key="bad", payload={},
                                   event_id=_scalar(c, "SELECT event_id FROM outbox LIMIT 1"))),
        ]

        class _Accepted(Exception):
            pass

        def try_all(conn: psycopg.Connection[Any]) -> list[tuple[str, str | None]]:
            results: list[tuple[str, str | None]] = []
            try:  # outside a transaction on an autocommit connection: refused, nothing written
                write_event(conn, topic=TOPIC, key="bad", payload={})
                results.append(("sdk_no_transaction", "accepted"))
            except TransactionRequired:
                results.append(("sdk_no_transaction", None))
            for name, expected, call in attempts:
                try:
                    with conn.transaction():
                        call(conn)
                        raise _Accepted()
                except _Accepted:
                    results.append((name, "accepted"))
                except expected:
                    results.append((name, None))
                except psycopg.OperationalError:
                    raise
                except Exception as exc:  # noqa: BLE001 - refused, but not the way it should be
                    results.append((name, f"refused with {type(exc).__name__}: {exc}"))
            return results

        for name, problem in self._with_db(try_all):
            with self._lock:
                self.bad_inputs["bad_write:" + name] += 1
                if problem is not None:
                    self.report.bad_input_failures.append(f"{name}: {problem}")

    def _heal_all(self) -> None:
        """Undo whatever a fault left behind (a fault thread that did not finish in time)."""
        assert self.proxy is not None and self.pg is not None
        self.proxy.restore()
        if not self.pg.running:
            self.pg.start()
        for m in self.members.values():
            m.thaw()
            if m.proc is None or not m.proc.alive:
                m.check()
                m.start()

    # -- the end --------------------------------------------------------------------------

    def _drain(self) -> None:
        """Wait until every written event is published and applied (and every job done)."""
        started = time.monotonic()
        deadline = started + self.cfg.drain_timeout_s
        next_progress = started + 10
        while True:
            self._watch()
            st = self._status()
            if st is not None and st["pending"] == 0 and st["effects"] >= st["written"] \
                    and st["poison_left"] == 0 and st["jobs_open"] == 0:
                self.report.drained = True
                break
            if time.monotonic() >= deadline:
                break
            if time.monotonic() >= next_progress:
                next_progress += 10
                self._progress("draining")
            time.sleep(0.5)  # polling interval of the drain condition
        self.report.drain_s = time.monotonic() - started
        self.say(f"drained={self.report.drained} after {self.report.drain_s:.1f} s")

    def _verify(self) -> None:
        r = self.report
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            written = {str(e): (k, int(s)) for e, k, s in conn.execute(
                "SELECT event_id, key, (payload->>'seq')::bigint FROM outbox WHERE key LIKE 'k%%'")}
            r.written = len(written)
            r.published = _scalar(conn, "SELECT count(*) FROM outbox WHERE key LIKE 'k%%' "
                                        "AND published_at IS NOT NULL")
            effects: dict[str, int] = dict(
                conn.execute("SELECT event_id::text, count(*) FROM soak_effects GROUP BY 1").fetchall())
            self._applied = effects.keys() & written.keys()
            r.effects_applied = len(self._applied)
            r.effect_duplicates = len([n for n in effects.values() if n > 1])
            r.effects_unknown = len(effects.keys() - written.keys())
            r.effect_order_violations = int(_scalar(conn, "SELECT coalesce(sum(regressions), 0) FROM soak_keys"))
            r.duplicates_dropped = _scalar(conn, "SELECT count(*) FROM soak_dups")
            dead = conn.execute("SELECT event_id::text, reason FROM outbox_dead_letters").fetchall()
            poison = set(self.poison_ids)
            r.poison_rows = len(poison)
            r.poison_dead_lettered = sum(1 for e, _ in dead if e in poison)
            r.good_rows_dead_lettered = sum(1 for e, _ in dead if e not in poison)
            if self.jobs_enabled:
                self._verify_jobs(conn, written)
        records = self._read_topic(TOPIC)
        first_seq: dict[str, int] = {}
        partitions: dict[str, set[int]] = {}
        delivered: set[str] = set()
        for rec in records:
            if "soak_bad" in rec.headers:
                continue
            r.kafka_records += 1
            event_id = rec.headers.get("event_id", b"").decode()
            if event_id in delivered:
                r.duplicates_delivered += 1
                continue
            delivered.add(event_id)
            body = json.loads(rec.value or b"{}")
            key, seq = body.get("key"), body.get("seq")
            if event_id not in written:
                r.unknown_delivered += 1
                if len(r.unknown_sample) < 10:
                    r.unknown_sample.append(f"{event_id} {key} seq {seq} (p{rec.partition}@{rec.offset})")
                continue
            partitions.setdefault(key, set()).add(rec.partition)
            if seq <= first_seq.get(key, 0):
                r.order_violations += 1
                if len(r.order_samples) < 10:
                    r.order_samples.append(f"{key}: seq {seq} after {first_seq[key]} (p{rec.partition}@{rec.offset})")
            first_seq[key] = max(seq, first_seq.get(key, 0))
        r.delivered_unique = len(delivered & written.keys())
        missing = written.keys() - delivered
        r.lost = len(missing)
        r.lost_sample = sorted(missing)[:10]
        if missing:
            self._diagnose_lost(missing, records)
        unapplied = written.keys() - self._applied
        if unapplied:
            self._diagnose_unapplied(unapplied, records)
        r.keys_on_several_partitions = sum(1 for p in partitions.values() if len(p) > 1)
        self._verify_dead_letters()

    def _diagnose_lost(self, missing: set[str], records: list[KafkaRecord]) -> None:
        """Where the consumers read each lost event (the inbox keeps the position of the
        applied copy) and what the topic holds there now: tells a relay that never
        published from a broker that lost or overwrote an acknowledged record."""
        at = {(rec.partition, rec.offset): rec for rec in records}
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT o.event_id::text, o.key, o.payload->>'seq', o.published_at, i.kafka_partition, "
                "i.kafka_offset, i.received_at FROM outbox o LEFT JOIN outbox_inbox i "
                "ON i.event_id = o.event_id AND i.consumer = %s WHERE o.event_id = ANY(%s::uuid[]) "
                "ORDER BY i.kafka_partition, i.kafka_offset", (GROUP, sorted(missing))).fetchall()
        lines = []
        for event_id, key, seq, published_at, partition, offset, received_at in rows:
            now = at.get((partition, offset))
            there = ("nothing" if now is None else
                     f"{now.headers.get('event_id', b'?').decode()} key {now.key!r}")
            lines.append(f"{event_id} {key} seq {seq} published {published_at}: applied from "
                         f"p{partition}@{offset} at {received_at}; the topic holds {there} there now")
        self.report.lost_detail = lines[:50]
        (self.workdir / "lost.txt").write_text("\n".join(lines) + "\n")

    def _diagnose_unapplied(self, unapplied: set[str], records: list[KafkaRecord]) -> None:
        """Where the events no consumer applied sit in the topic, against the group's
        committed offsets: offsets committed past them (skipped) or not (never consumed)."""
        where: dict[int, list[int]] = {}
        seen: set[str] = set()
        for rec in records:
            event_id = rec.headers.get("event_id", b"").decode()
            if event_id in unapplied and event_id not in seen:
                seen.add(event_id)
                where.setdefault(rec.partition, []).append(rec.offset)
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": GROUP, "logger": _KAFKA_LOG,
                             "enable.auto.commit": False})
        try:
            committed = {tp.partition: tp.offset for tp in consumer.committed(
                [TopicPartition(TOPIC, p) for p in range(self.cfg.partitions)], timeout=30)}
        except Exception as exc:  # noqa: BLE001 - a diagnosis only
            committed = {}
            self.say(f"committed offsets unavailable: {exc}")
        finally:
            consumer.close()
        lines = [f"{len(unapplied)} written events have no effect; {len(unapplied) - len(seen)} of them are not "
                 f"in the topic at all"]
        for partition, offsets in sorted(where.items()):
            lines.append(f"p{partition}: {len(offsets)} unapplied at offsets {min(offsets)}..{max(offsets)}; "
                         f"group {GROUP!r} committed offset {committed.get(partition)}")
        self.report.unapplied_detail = lines
        (self.workdir / "unapplied.txt").write_text("\n".join(lines) + "\n")

    def _verify_jobs(self, conn: psycopg.Connection[Any], written: dict[str, tuple[str, int]]) -> None:
        r = self.report
        r.jobs_enabled = True
        r.jobs_expected = sum(1 for _k, s in written.values() if s % JOB_EVERY == 0)
        rows = conn.execute(
            "SELECT j.id, j.status, (SELECT count(*) FROM soak_job_effects e WHERE e.job_id = j.id) "
            "FROM jobs j WHERE j.queue = 'soak'").fetchall()
        r.jobs_enqueued = len(rows)
        r.jobs_not_succeeded = sum(1 for _i, status, _n in rows if status != "succeeded")
        r.job_effects_duplicated = sum(1 for _i, _s, n in rows if n > 1)
        r.job_effects_missing = sum(1 for _i, _s, n in rows if n == 0)
        r.jobs_completed_once = sum(1 for _i, status, n in rows if status == "succeeded" and n == 1)
        r.jobs_dead_lettered = _scalar(conn, "SELECT count(*) FROM job_dead_letters WHERE queue = 'soak'")

    def _read_topic(self, topic: str, quiet_s: float = 3.0, timeout_s: float = 600.0) -> list[KafkaRecord]:
        """Every record of ``topic``, through the proxy, ordered by (partition, offset).

        Reads each partition from the beginning (assign, no group) until every partition
        reported its end and nothing new came for ``quiet_s``: the topic is quiet by now,
        and unlike a count or a high watermark taken beforehand this cannot stop short
        (a stale watermark is reported in ``watermark_mismatches``).
        """
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "logger": _KAFKA_LOG,
                             "group.id": f"soak-verify-{uuid.uuid4().hex[:6]}", "enable.auto.commit": False,
                             "enable.partition.eof": True, "fetch.wait.max.ms": 50,
                             "auto.offset.reset": "earliest"})
        records: list[KafkaRecord] = []
        try:
            parts = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
            marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
            at_end: set[int] = set()
            deadline = time.monotonic() + timeout_s
            last_new = time.monotonic()
            while time.monotonic() < deadline:
                batch = consumer.consume(num_messages=1000, timeout=0.2)
                for msg in batch:
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            at_end.add(msg.partition() or 0)
                        continue
                    at_end.discard(msg.partition() or 0)
                    last_new = time.monotonic()
                    raw = msg.headers() or []
                    pairs: list[tuple[str, Any]] = list(raw.items() if isinstance(raw, dict) else raw)
                    records.append(KafkaRecord(
                        topic=topic, partition=msg.partition() or 0, offset=msg.offset() or 0, key=msg.key(),
                        value=msg.value(), timestamp_ms=None,
                        headers={k: (v.encode() if isinstance(v, str) else (v or b"")) for k, v in pairs}))
                if at_end == set(parts) and time.monotonic() - last_new >= quiet_s:
                    break
            else:
                raise RuntimeError(f"reading {topic} did not reach the end within {timeout_s} s")
        finally:
            consumer.close()
        records.sort(key=lambda rec: (rec.partition, rec.offset))
        ends: dict[int, int] = {}
        for rec in records:
            ends[rec.partition] = max(ends.get(rec.partition, 0), rec.offset + 1)
        for p, high in marks.items():
            if ends.get(p, 0) != high:
                self.report.watermark_mismatches.append(
                    f"{topic}[{p}]: high watermark {high} before reading, last offset read + 1 = {ends.get(p, 0)}")
        if topic == TOPIC:
            self.report.partition_records = {f"p{p}": sum(1 for r in records if r.partition == p) for p in parts}
        return records

    def _verify_dead_letters(self) -> None:
        r = self.report
        r.bad_messages_sent = len(self.bad_messages)
        letters = self._read_topic(DLQ_TOPIC)
        seen: set[str] = set()
        for rec in letters:
            bad_id = rec.headers.get("soak_bad")
            if bad_id is None:
                r.good_events_dead_lettered += 1
                continue
            key = bad_id.decode()
            if self.bad_messages.get(key) == rec.headers.get("dlq_reason", b"").decode():
                seen.add(key)
            else:
                r.bad_input_failures.append(f"bad message {key}: dead-lettered with "
                                            f"{rec.headers.get('dlq_reason')!r}, expected {self.bad_messages.get(key)!r}")
        r.bad_messages_dead_lettered = len(seen)

    def _stop_all(self) -> None:
        """SIGTERM every process (relays last, so consumers settle), then count what they did."""
        order = sorted(self.members.values(), key=lambda m: {"worker": 0, "consumer": 1, "relay": 2}[m.role])
        for m in order:
            code = m.stop()
            if code != 0:
                self.report.unclean_stops.append(f"{m.name}: exit code {code}: {m.log_path}")
        relays = [m for m in self.members.values() if m.role == "relay"]
        self.report.fenced_writes = int(sum(m.counter("outbox_relay_fenced_writes_total") for m in relays))
        self.report.relay_leases_lost = int(sum(m.counter("outbox_relay_leases_lost_total") for m in relays))
        self.report.relay_order_violations_metric = int(
            sum(m.counter("outbox_relay_order_violations_total") for m in relays))
        self.report.lease_lost_log_events = sum(_count_events(m.log_path, "lease_lost") for m in relays)
        self.report.jobs_leases_lost_logged = sum(
            _count_events(m.log_path, "lease_lost") for m in self.members.values() if m.role == "worker")

    def _finish_report(self) -> None:
        r, w = self.report, self.writers
        assert w is not None
        r.written_tx = w.transactions
        r.writer_failed_tx = w.failed
        r.writer_unknown_outcome_tx = w.unknown
        write_s = max(1e-9, w.stopped_at - w.started_at)
        r.events_per_s_held = r.written / write_s
        r.slowest_window_events_per_s = w.slowest_window()
        r.peak_backlog = self.peak_backlog
        r.faults_by_kind = dict(sorted(self.faults.items()))
        r.bad_inputs_by_kind = dict(sorted(self.bad_inputs.items()))
        r.jobs_enabled = self.jobs_enabled
        r.jobs_note = self.jobs_note
        r.unexpected_exits = [e for m in self.members.values() for e in m.unexpected_exits]
        r.wall_s = time.monotonic() - self.t0
        r.fault_log = sorted(self.fault_log)
        (self.workdir / "faults.txt").write_text("\n".join(r.fault_log) + "\n")

    def close(self) -> None:
        """Kill every process and stop the services; idempotent, also after a failure."""
        self._abort.set()
        if self.writers is not None:
            self.writers.stop()
        for m in self.members.values():
            try:
                m.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
        for server, name in ((self.broker, "tansu.log"), (self.pg, "postgres.log")):
            if server is not None and server.log_path.exists():
                try:
                    shutil.copyfile(server.log_path, self.workdir / name)
                except OSError:
                    pass
        if self.broker is not None:
            self.broker.close()  # also stops the proxy
        if self.pg is not None:
            self.pg.close()


def _scalar(conn: psycopg.Connection[Any], sql: str, params: Any = None) -> Any:
    """The first column of the first row (None without a row)."""
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]


def _count_events(path: Path, event: str) -> int:
    """JSON log lines whose ``event`` is ``event``."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return 0
    return len(re.findall(r'"event":\s*"' + re.escape(event) + '"', text))


def run_soak(config: SoakConfig, *, log: Callable[[str], None] = print) -> SoakReport:
    """Run a soak and return its report (check ``report.failures()``); always cleans up."""
    soak = Soak(config, log=log)
    try:
        soak.setup()
        return soak.run()
    finally:
        soak.close()


# ---------------------------------------------------------------------------------------
# command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=300.0, help="time faults and writes run (default 300)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the fault plan and the writers (default random)")
    parser.add_argument("--relays", type=int, default=3)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="job workers (0: no jobs)")
    parser.add_argument("--rate", type=float, default=300.0, help="events/s written (default 300)")
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--mean-fault-gap-s", type=float, default=5.0)
    parser.add_argument("--drain-timeout-s", type=float, default=240.0)
    parser.add_argument("--workdir", type=Path, default=None, help="where process logs go (default a temp dir, kept)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    config = SoakConfig(duration_s=args.duration_s, seed=seed, relays=args.relays, consumers=args.consumers,
                        workers=args.workers, rate=args.rate, keys=args.keys, partitions=args.partitions,
                        mean_fault_gap_s=args.mean_fault_gap_s, drain_timeout_s=args.drain_timeout_s,
                        workdir=args.workdir, jobs=None if args.workers > 0 else False)

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)

    def say(text: str) -> None:
        print(text, flush=True)

    say(f"chaos soak: seed {seed}, {args.duration_s:g} s, {args.relays} relays, {args.consumers} consumers, "
        f"{args.workers} workers, {args.rate:g} events/s")
    try:
        report = run_soak(config, log=say)
    except KeyboardInterrupt:
        say(f"interrupted; everything was stopped (seed {seed})")
        return 130
    say(report.render())
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
