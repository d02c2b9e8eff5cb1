"""The soak's constants, what to run (:class:`SoakConfig`) and the figures of a run
(:class:`SoakReport`, whose :meth:`~SoakReport.failures` are the invariants)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[2]  # tests/soak/config.py -> the repository
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
    #: "kafka": Apache Kafka (tansu when it cannot start, outside CI); "tansu": tansu.
    broker: str = "kafka"


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
    broker: str = ""
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
            f"consumers={self.consumers}  workers={self.workers if self.jobs_enabled else 0}  "
            f"broker={self.broker or '?'}",
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
            f"--rate {self.target_rate:g} --mean-fault-gap-s {self.mean_fault_gap_s:g}"
            + (" --broker tansu" if self.broker == "tansu" else ""),
            "-" * 78,
            "RESULT: PASS" if not failures else "RESULT: FAIL\n  - " + "\n  - ".join(failures),
            "=" * 78,
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# shared by the run, the faults and the verification


def _scalar(conn: psycopg.Connection[Any], sql: str, params: Any = None) -> Any:
    """The first column of the first row (None without a row)."""
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]
