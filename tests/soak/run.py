"""The soak itself: :class:`Soak` sets up the services and processes, writes, runs the
fault plan, and stops everything; :func:`run_soak` runs one and returns its report."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg

from relay import migrate
from tests.fixtures import apache_kafka
from tests.fixtures.broker import Broker, create_topic, tansu_broker_behind_proxy
from tests.fixtures.pg import EmbeddedPgServer, embedded_pg
from tests.fixtures.pg_user import prepare as prepare_pg_user
from tests.fixtures.proxy import TcpProxy
from tests.soak.config import (
    DLQ_TOPIC,
    JOB_EVERY,
    MEMBER_SCRIPT,
    RELAY_HEARTBEAT_S,
    RELAY_LEASE_S,
    ROOT,
    SOAK_DDL,
    TOPIC,
    WORKER_LEASE_S,
    SoakConfig,
    SoakReport,
    _scalar,
)
from tests.soak.faults import FaultInjection
from tests.soak.members import Member, Writers
from tests.soak.plan import Fault, plan_faults
from tests.soak.verify import Verification


class Soak(FaultInjection, Verification):
    """Owns the services, the processes, the writers and the chaos; see the package docstring."""

    def __init__(self, config: SoakConfig, log: Callable[[str], None] = print) -> None:
        self.cfg = config
        self._say = log
        self.t0 = time.monotonic()
        self.workdir = config.workdir or Path(tempfile.mkdtemp(prefix=f"soak-{config.seed}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pg: EmbeddedPgServer | None = None
        self.broker: Broker | None = None
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
        prepare_pg_user()  # run as root: the user the embedded PostgreSQL runs as
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
        broker = self._start_broker()
        create_topic(self.bootstrap, TOPIC, partitions=self.cfg.partitions)
        create_topic(self.bootstrap, DLQ_TOPIC, partitions=1)
        self.jobs_enabled, self.jobs_note = self._jobs_available()
        self.say(f"PostgreSQL {self.pg.port}, {broker} via proxy {self.bootstrap}, "
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

    def _start_broker(self) -> str:
        """The broker behind the fault proxy: Apache Kafka unless the config asks for tansu or
        (outside CI) Java or the jars are missing; says which, and why not Apache Kafka."""
        if self.cfg.broker == "kafka":
            why_not = apache_kafka.missing_tools()
            if why_not is None:
                try:
                    kafka, self.proxy = apache_kafka.apache_kafka_behind_proxy()
                except apache_kafka.KafkaUnavailableError as exc:
                    why_not = str(exc)
                else:
                    self.broker = kafka
                    self.bootstrap = f"127.0.0.1:{self.proxy.port}"
                    self.report.broker = f"Apache Kafka {apache_kafka.kafka_version()}"
                    apache_kafka.warm_up_groups(self.bootstrap)  # the group coordinator is up
                    return f"{self.report.broker} at {kafka.bootstrap}"
            if apache_kafka.in_ci():
                raise RuntimeError(f"Apache Kafka cannot start: {why_not} (CI=true: no fallback)")
            self.say(f"Apache Kafka cannot start ({why_not}): the soak runs on tansu")
        tansu, self.proxy = tansu_broker_behind_proxy()
        self.broker = tansu
        self.bootstrap = tansu.bootstrap
        self.report.broker = "tansu"
        return f"tansu at {tansu.direct_bootstrap}"

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
                return False, "no jobs table (outbox_core/sql/migrations/0005_jobs.sql missing)"
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

    # -- the end --------------------------------------------------------------------------

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
        broker_log = "tansu.log" if self.report.broker == "tansu" else "kafka.log"
        for server, name in ((self.broker, broker_log), (self.pg, "postgres.log")):
            if server is not None and getattr(server, "log_path", None) is not None and server.log_path.exists():
                try:
                    shutil.copyfile(server.log_path, self.workdir / name)
                except OSError:
                    pass
        if self.broker is not None:
            self.broker.close()  # tansu's also stops the proxy
        if self.proxy is not None:
            self.proxy.stop()
        if self.pg is not None:
            self.pg.close()


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
