"""A jobs worker pool as a real process, for tests/faults/test_jobs_faults.py.

Handlers:
  steps  payload {"steps": n, "step_s": s, "in_tx": bool, "one_trip": bool}: n steps, each
         sleeps s then, in ONE fenced transaction, inserts an `effects` row and writes result
         "step-<i>" by key; steps whose result exists (an earlier attempt committed them) are
         skipped.  So every step's effect commits exactly once across attempts, takeovers
         and stale owners.  With in_tx the sleep happens inside the fenced transaction (its
         row lock held), after printing `in_tx step=<i>`; with one_trip the effect and the
         result are one statement through ctx.fenced_execute (one round trip).
  hold   payload {"hold_s": s}: records (job, owner) in `effects` (fenced), sleeps s.

Logs JSON lines (structlog) to stdout; prints `worker_ready` once started.  SIGTERM stops
gracefully.

    python tests/faults/_jobs_worker_proc.py --dsn ... --name A [--lease-s 2] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402
from psycopg.types.json import Jsonb  # noqa: E402

from consumer_sdk.jobs import JobContext, WorkerConfig, WorkerPool  # noqa: E402

EFFECT = "INSERT INTO effects (job_id, token, step, worker) VALUES (%s, %s, %s, %s)"
EFFECT_AND_RESULT = """
WITH effect AS (
    INSERT INTO effects (job_id, token, step, worker) VALUES (%(id)s, %(token)s, %(step)s, %(worker)s)
)
INSERT INTO job_results (job_id, key, value, lease_token) VALUES (%(id)s, %(key)s, %(value)s, %(token)s)
ON CONFLICT (job_id, key) DO UPDATE SET value = excluded.value, lease_token = excluded.lease_token
"""


def make_handlers(name: str) -> dict[str, Any]:
    def steps(ctx: JobContext) -> Any:
        body = ctx.payload
        done = ctx.results()
        for i in range(body["steps"]):
            key = f"step-{i}"
            if key in done:
                continue
            if not body.get("in_tx"):
                ctx.sleep(body["step_s"])
            if body.get("one_trip"):  # the effect and the result in one fenced statement
                ctx.fenced_execute(EFFECT_AND_RESULT, {"id": ctx.job.id, "token": ctx.job.token, "step": i,
                                                       "worker": name, "key": key,
                                                       "value": Jsonb({"step": i, "by": name})})
                print(f"step_done job={ctx.job.id} step={i} token={ctx.job.token}", flush=True)
                continue
            with ctx.fenced_transaction() as conn:
                conn.execute(EFFECT, (ctx.job.id, ctx.job.token, i, name))
                ctx.put_result(key, {"step": i, "by": name})
                if body.get("in_tx"):
                    print(f"in_tx step={i}", flush=True)
                    time.sleep(body["step_s"])  # noqa: TID251 - the job's work, held inside its transaction
            print(f"step_done job={ctx.job.id} step={i} token={ctx.job.token}", flush=True)
        return {"steps": body["steps"], "finished_by": name}

    def hold(ctx: JobContext) -> Any:
        with ctx.fenced_transaction() as conn:
            conn.execute(EFFECT, (ctx.job.id, ctx.job.token, 0, name))
        ctx.sleep(ctx.payload["hold_s"])
        return None

    return {"steps": steps, "hold": hold}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--lease-s", type=float, default=2.0)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--owner-limit", type=int, default=1_000_000)
    parser.add_argument("--queues", default="interactive,bulk")
    args = parser.parse_args()
    structlog.configure(processors=[structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso"),
                                    structlog.processors.JSONRenderer()])
    config = WorkerConfig(dsn=args.dsn, worker_id=args.name, queues=tuple(args.queues.split(",")),
                          max_concurrency=args.concurrency, owner_limit=args.owner_limit,
                          lease_s=args.lease_s, heartbeat_s=args.heartbeat_s,
                          poll_interval_s=args.poll_s, reconcile_interval_s=1.0, drain_timeout_s=2.0)
    pool = WorkerPool(config, make_handlers(args.name))
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    pool.start()
    print("worker_ready", flush=True)
    stopped.wait()
    pool.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
