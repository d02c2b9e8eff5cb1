"""Jobs benchmark (test 8 of the issue): throughput at a steady rate while workers are killed,
next to the numbers that must stay at zero.  Not part of the test suite (a smoke run is).

    python python -m outbox_embedded.jobs_bench --dsn postgresql://postgres@127.0.0.1:5432/test --seconds 30
    python python -m outbox_embedded.jobs_bench --seconds 20 --rate 300 --workers 3 --kill-every-s 4   # embedded PG

It creates (and drops) its own database on the server of --dsn (or $OUTBOX_TEST_DSN, else an
embedded PostgreSQL), starts --workers worker processes, enqueues --rate jobs/s for --seconds
across --owners owners (owner o0 gets half of them, so the per-owner limit binds), SIGKILLs a
random worker every --kill-every-s and starts a replacement, samples the running jobs per owner
every 20 ms, then waits for every job to finish.  The last line on stdout is a JSON report:

  jobs_per_s             jobs finished per second during the steady phase
  duplicate_completions  jobs that reached 'succeeded' more than once       (must be 0)
  duplicate_executions   jobs whose handler's fenced effect committed twice (a kill between
                         that commit and the completion; what results-by-key absorb)
  re_executions          attempts beyond the first (the work kills cost)
  limit_violations       samples with an owner above --owner-limit          (must be 0)
  unfinished             jobs not terminal after the drain                  (must be 0)
  dead_tuples_max        largest n_dead_tup of `jobs` seen (vacuum keeping up?)
  hot_update_ratio       share of `jobs` updates that were HOT (heartbeats should be)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import psycopg

from consumer_sdk.jobs import JobContext, NewJob, WorkerConfig, WorkerPool, enqueue

BENCH_DDL = """
CREATE TABLE IF NOT EXISTS bench_effects (job_id bigint NOT NULL, token bigint NOT NULL);
CREATE TABLE IF NOT EXISTS bench_completions (job_id bigint NOT NULL);
CREATE OR REPLACE FUNCTION bench_completion() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO bench_completions VALUES (NEW.id); RETURN NULL; END $$;
DROP TRIGGER IF EXISTS bench_completion ON jobs;
CREATE TRIGGER bench_completion AFTER UPDATE OF status ON jobs FOR EACH ROW
    WHEN (NEW.status = 'succeeded') EXECUTE FUNCTION bench_completion();
"""
SAMPLE = ("SELECT owner_id, count(*) FROM jobs WHERE status = 'running' AND lease_until > now() "
          "GROUP BY owner_id")
EFFECT = "INSERT INTO bench_effects (job_id, token) VALUES (%s, %s)"


# -- the worker process ----------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> int:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks when jobs stay unfinished

    def hold(ctx: JobContext) -> Any:
        ctx.sleep(ctx.payload["hold_s"])
        with ctx.fenced_transaction() as conn:
            conn.execute(EFFECT, (ctx.job.id, ctx.job.token))
            ctx.put_result("done", True)
        return None

    config = WorkerConfig(dsn=args.dsn, worker_id=args.name, max_concurrency=args.concurrency,
                          queue_limits={"bulk": max(1, args.concurrency - 1)}, owner_limit=args.owner_limit,
                          lease_s=args.lease_s, poll_interval_s=0.25, reconcile_interval_s=1.0,
                          drain_timeout_s=1.0)
    pool = WorkerPool(config, {"hold": hold})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    pool.start()
    print("worker_ready", flush=True)
    stop.wait()
    pool.stop()
    return 0


# -- the driver --------------------------------------------------------------------------------


class Fleet:
    """The worker processes; SIGKILLs one at random and replaces it."""

    def __init__(self, args: argparse.Namespace, dsn: str) -> None:
        self.args, self.dsn = args, dsn
        self.procs: list[subprocess.Popen[bytes]] = []
        self.kills = 0
        self.generation = 0

    def spawn(self) -> subprocess.Popen[bytes]:
        self.generation += 1
        cmd = [sys.executable, "-m", "outbox_embedded.jobs_bench", "worker", "--dsn", self.dsn,
               "--name", f"w{self.generation}-{uuid.uuid4().hex[:6]}", "--concurrency",
               str(self.args.concurrency), "--owner-limit", str(self.args.owner_limit),
               "--lease-s", str(self.args.lease_s)]
        if self.args.log_dir is None:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            with open(os.path.join(self.args.log_dir, f"worker-{self.generation}.log"), "ab") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=log)  # the worker has its own descriptor
        self.procs.append(proc)
        return proc

    def kill_one(self) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        if alive:
            victim = random.choice(alive)
            victim.kill()
            victim.wait()
            self.kills += 1
            self.spawn()

    def dump_stacks(self) -> None:
        """Each live worker writes its threads' stacks to its log (faulthandler, SIGUSR1)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(1.0)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


class Sampler(threading.Thread):
    """Running jobs per owner every 20 ms, and the dead tuples of `jobs` every second."""

    def __init__(self, dsn: str, limit: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.limit = dsn, limit
        self.stop_event = threading.Event()
        self.samples = self.violations = self.max_per_owner = self.dead_max = 0

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            last_dead = 0.0
            while not self.stop_event.wait(0.02):
                counts = [n for _owner, n in conn.execute(SAMPLE).fetchall()]
                self.samples += 1
                self.max_per_owner = max([self.max_per_owner, *counts])
                self.violations += any(n > self.limit for n in counts)
                if time.monotonic() - last_dead >= 1.0:
                    last_dead = time.monotonic()
                    self.dead_max = max(self.dead_max, dead_tuples(conn))


def dead_tuples(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'jobs'").fetchone()
    return int(row[0]) if row else 0


def produce(conn: psycopg.Connection[Any], args: argparse.Namespace, stop: threading.Event) -> int:
    """Enqueue at --rate jobs/s in 100 ms batches until --seconds pass; returns the count."""
    total, started = 0, time.monotonic()
    while not stop.is_set() and time.monotonic() - started < args.seconds:
        due = int(args.rate * (time.monotonic() - started)) - total
        batch = [NewJob(owner_id="o0" if random.random() < 0.5 else f"o{random.randrange(1, args.owners)}",
                        queue="interactive" if random.random() < 0.05 else "bulk", kind="hold",
                        payload={"hold_s": args.hold_ms / 1000}) for _ in range(max(0, due))]
        enqueue(conn, batch)
        total += len(batch)
        time.sleep(0.1)
    return total


#: What a job left unfinished looks like (at most 5): the first thing to read when the bench fails.
UNFINISHED = """
SELECT id, status, attempts, lease_owner, lease_token,
       round(extract(epoch FROM lease_until - now())::numeric, 2) AS lease_left_s,
       round(extract(epoch FROM available_at - now())::numeric, 2) AS available_in_s,
       round(extract(epoch FROM now() - heartbeat_at)::numeric, 2) AS heartbeat_age_s, last_error
FROM jobs WHERE status NOT IN ('succeeded', 'failed', 'cancelled') ORDER BY id LIMIT 5
"""

#: The database's sessions (not this one), for a run that left jobs unfinished: who waits on what.
SESSIONS = """
SELECT pid, application_name, state, wait_event_type, wait_event, pg_blocking_pids(pid),
       round(extract(epoch FROM now() - xact_start)::numeric, 2) AS xact_age_s, left(query, 160)
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
ORDER BY pid
"""


def report(conn: psycopg.Connection[Any], args: argparse.Namespace, enqueued: int, steady_s: float,
           finished_in_steady: int, fleet: Fleet, sampler: Sampler) -> dict[str, Any]:
    def one(sql: str) -> Any:
        row = conn.execute(sql).fetchone()
        return row[0] if row else None

    return {
        "enqueued": enqueued,
        "succeeded": one("SELECT count(*) FROM jobs WHERE status = 'succeeded'"),
        "jobs_per_s": round(finished_in_steady / steady_s, 1),
        "duplicate_completions": one("SELECT count(*) FROM (SELECT job_id FROM bench_completions "
                                     "GROUP BY job_id HAVING count(*) > 1) d"),
        "duplicate_executions": one("SELECT count(*) FROM (SELECT job_id FROM bench_effects "
                                    "GROUP BY job_id HAVING count(*) > 1) d"),
        "re_executions": one("SELECT coalesce(sum(attempts - 1), 0)::bigint FROM jobs WHERE status = 'succeeded'"),
        "limit_violations": sampler.violations,
        "max_running_per_owner": sampler.max_per_owner,
        "owner_limit": args.owner_limit,
        "samples": sampler.samples,
        "unfinished": one("SELECT count(*) FROM jobs WHERE status NOT IN ('succeeded', 'failed', 'cancelled')"),
        "unfinished_jobs": [list(map(str, r)) for r in conn.execute(UNFINISHED).fetchall()],
        "sessions_then": [list(map(str, r)) for r in conn.execute(SESSIONS).fetchall()]
        if one("SELECT count(*) FROM jobs WHERE status NOT IN ('succeeded', 'failed', 'cancelled')") else [],
        "failed": one("SELECT count(*) FROM jobs WHERE status = 'failed'"),
        "dead_tuples_max": sampler.dead_max,
        "dead_tuples_end": dead_tuples(conn),
        "hot_update_ratio": one("SELECT round(n_tup_hot_upd::numeric / greatest(n_tup_upd, 1), 3)::float8 "
                                "FROM pg_stat_user_tables WHERE relname = 'jobs'"),
        "start_latency_p50_s": one("SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY "
                                   "extract(epoch FROM started_at - created_at))::numeric, 3)::float8 FROM jobs"),
        "start_latency_p99_s": one("SELECT round(percentile_cont(0.99) WITHIN GROUP (ORDER BY "
                                   "extract(epoch FROM started_at - created_at))::numeric, 3)::float8 FROM jobs"),
        "kills": fleet.kills,
        "workers": args.workers, "concurrency": args.concurrency, "rate": args.rate,
        "seconds": args.seconds,
    }


def drive(args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    from relay import migrate

    migrate.apply(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BENCH_DDL)
        fleet, sampler, stop = Fleet(args, dsn), Sampler(dsn, args.owner_limit), threading.Event()
        try:
            for _ in range(args.workers):
                fleet.spawn()
            sampler.start()
            killer = threading.Thread(target=_kill_loop, args=(fleet, args.kill_every_s, stop), daemon=True)
            killer.start()
            started = time.monotonic()
            enqueued = produce(conn, args, stop)
            steady_s = time.monotonic() - started
            finished = conn.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone()
            stop.set()
            deadline = time.monotonic() + args.drain_timeout_s
            while time.monotonic() < deadline and conn.execute(
                    "SELECT count(*) FROM jobs WHERE finished_at IS NULL").fetchone()[0]:  # type: ignore[index]
                time.sleep(0.2)
            sampler.stop_event.set()
            sampler.join(5)
            if conn.execute("SELECT count(*) FROM jobs WHERE finished_at IS NULL").fetchone()[0]:  # type: ignore[index]
                fleet.dump_stacks()  # where the workers' threads are, in their logs (--log-dir)
            return report(conn, args, enqueued, steady_s, int(finished[0]) if finished else 0, fleet, sampler)
        finally:
            stop.set()
            fleet.stop()


def _kill_loop(fleet: Fleet, every_s: float, stop: threading.Event) -> None:
    while every_s > 0 and not stop.wait(every_s):
        fleet.kill_one()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=["run", "worker"], default="run")
    parser.add_argument("--dsn", default=os.environ.get("OUTBOX_TEST_DSN"))
    parser.add_argument("--name", default="w")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=200.0, help="jobs enqueued per second")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4, help="jobs per worker at once")
    parser.add_argument("--owners", type=int, default=20)
    parser.add_argument("--owner-limit", type=int, default=3)
    parser.add_argument("--hold-ms", type=float, default=10.0, help="each job's work")
    parser.add_argument("--lease-s", type=float, default=2.0)
    parser.add_argument("--kill-every-s", type=float, default=4.0, help="0: never kill")
    parser.add_argument("--drain-timeout-s", type=float, default=60.0)
    parser.add_argument("--log-dir", default=None, help="each worker's warnings to a file here (default: none)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.mode == "worker":
        return run_worker(args)
    from outbox_embedded.pg import embedded_pg, external_pg

    server = external_pg(args.dsn) if args.dsn else embedded_pg()
    name = f"jobs_bench_{uuid.uuid4().hex[:8]}"
    try:
        result = drive(args, server.create_database(name))
    finally:
        server.drop_database(name)
        server.close()
    print(json.dumps(result), flush=True)
    ok = not (result["duplicate_completions"] or result["limit_violations"] or result["unfinished"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
