"""``python -m consumer_sdk.jobs``: read dead letters and runs, requeue, reconcile, clean up.

    python -m consumer_sdk.jobs dead-letters list --dsn postgresql://... [--queue bulk] [--json]
    python -m consumer_sdk.jobs dead-letters requeue JOB_ID --dsn ...
    python -m consumer_sdk.jobs runs show RUN_ID --dsn ...
    python -m consumer_sdk.jobs reconcile --dsn ... [--queues interactive,bulk]
    python -m consumer_sdk.jobs cleanup --older-than-days 30 --dsn ...

The DSN may also come from ``$OUTBOX_JOBS_DSN``.  Exit codes: 0 done, 1 not
found, 2 usage, 3 database unavailable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO

import psycopg

from consumer_sdk.errors import OutboxSdkError
from consumer_sdk.jobs import admin
from consumer_sdk.jobs.model import BULK, INTERACTIVE, DeadLetterRecord
from consumer_sdk.jobs.reconciler import Reconciler
from consumer_sdk.jobs.runs import error_reference, run_status

ENV_DSN = "OUTBOX_JOBS_DSN"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m consumer_sdk.jobs",
        description="Runs and jobs: read dead letters and runs, requeue, reconcile, clean up.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", default=os.environ.get(ENV_DSN), help=f"PostgreSQL DSN (env {ENV_DSN})")
    common.add_argument("--json", action="store_true", help="one JSON object per line")
    top = parser.add_subparsers(dest="area", required=True)
    dead = top.add_parser("dead-letters", help="jobs that ended in 'failed'").add_subparsers(
        dest="action", required=True)
    listing = dead.add_parser("list", parents=[common], help="newest first")
    listing.add_argument("--queue")
    listing.add_argument("--limit", type=int, default=50)
    show = dead.add_parser("show", parents=[common], help="one job's dead letter")
    show.add_argument("job_id", type=int)
    requeue = dead.add_parser("requeue", parents=[common], help="queue the job again, fresh attempts")
    requeue.add_argument("job_id", type=int)
    runs = top.add_parser("runs", help="runs").add_subparsers(dest="action", required=True)
    run_show = runs.add_parser("show", parents=[common], help="a run's status")
    run_show.add_argument("run_id")
    reconcile = top.add_parser("reconcile", parents=[common], help="one reconciler pass")
    reconcile.add_argument("--queues", default=f"{INTERACTIVE},{BULK}")
    cleanup = top.add_parser("cleanup", parents=[common], help="retention of finished runs and jobs")
    cleanup.add_argument("--older-than-days", type=float, required=True,
                         help="keep longer than any client retries a request (request keys go too)")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = build_parser().parse_args(argv)
    if not args.dsn:
        print(f"error: --dsn or ${ENV_DSN} is required", file=sys.stderr)
        return 2
    try:
        with psycopg.connect(args.dsn, autocommit=True, connect_timeout=10,
                             application_name="outbox-jobs-cli") as conn:
            return _run(conn, args, out)
    except psycopg.OperationalError as exc:
        print(f"error: database unavailable: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 3
    except OutboxSdkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


def _run(conn: psycopg.Connection[Any], args: argparse.Namespace, out: TextIO) -> int:
    if args.area == "dead-letters" and args.action in ("list", "show"):
        records = admin.dead_letters(conn, queue=getattr(args, "queue", None),
                                     job_id=getattr(args, "job_id", None),
                                     limit=getattr(args, "limit", 1))
        for record in records:
            print(_json(asdict(record)) if args.json else _text(record), file=out)
        return 0 if records or args.action == "list" else 1
    if args.area == "dead-letters":
        done = admin.requeue_dead(conn, args.job_id)
        print(f"job {args.job_id} {'queued again' if done else 'has no dead letter'}", file=out)
        return 0 if done else 1
    if args.area == "runs":
        state = run_status(conn, args.run_id)
        if state is None:
            print(f"no run {args.run_id}", file=out)
            return 1
        print(_json({**asdict(state), "error_reference": error_reference(state)}), file=out)
        return 0
    if args.area == "cleanup":
        finished, activations = admin.cleanup(conn, older_than_s=args.older_than_days * 86400)
        print(_json({"runs_and_jobs_deleted": finished, "activations_deleted": activations}), file=out)
        return 0
    result = Reconciler(queues=args.queues.split(",")).run_once(conn)
    print(_json(asdict(result)), file=out)
    return 0


def _text(r: DeadLetterRecord) -> str:
    return (f"job {r.job_id} ({r.queue}/{r.kind}, run {r.run_id}) dead at {r.dead_at:%Y-%m-%d %H:%M:%S%z}\n"
            f"  reason:   {r.reason} after {r.attempts} attempt(s)\n"
            f"  error:    {r.error}\n"
            f"  trace_id: {r.trace_id or '-'}")


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)
