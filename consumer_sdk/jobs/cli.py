"""``python -m consumer_sdk.jobs``: read dead letters and runs, requeue, reconcile, clean up.

    python -m consumer_sdk.jobs dead-letters list --dsn postgresql://... [--queue bulk] [--json]
    python -m consumer_sdk.jobs dead-letters requeue JOB_ID --dsn ...
    python -m consumer_sdk.jobs runs show RUN_ID --dsn ...
    python -m consumer_sdk.jobs reconcile --dsn ... [--queues interactive,bulk]
    python -m consumer_sdk.jobs cleanup --older-than-days 30 --dsn ...

Conventions shared with ``outbox-relay`` (README, "One set of conventions"): every
option ``--some-option`` can also come from ``OUTBOX_<PROGRAM>_SOME_OPTION``, here
``OUTBOX_JOBS_SOME_OPTION`` (the flag wins); exit codes 0 done, 1 failure (not found,
database unavailable), 2 usage or configuration, 3 schema missing, 4 credentials rejected.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, TextIO

import psycopg

from consumer_sdk import _pg
from consumer_sdk.errors import ConfigError, OutboxSdkError
from consumer_sdk.jobs import admin
from consumer_sdk.jobs.model import BULK, INTERACTIVE, QUEUE_NAME, DeadLetterRecord
from consumer_sdk.jobs.reconciler import Reconciler, active_queues
from consumer_sdk.jobs.runs import error_reference, run_status
from consumer_sdk.secrets import mask_text, validate_dsn
from outbox_core.text import first_undecodable

ENV_PREFIX = "OUTBOX_JOBS_"
ENV_DSN = ENV_PREFIX + "DSN"


def env_name(flag: str) -> str:
    """``--older-than-days`` -> ``OUTBOX_JOBS_OLDER_THAN_DAYS`` (the relay's rule, its own prefix)."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _env_default(flag: str, env: Mapping[str, str]) -> str | None:
    return env.get(env_name(flag))


def _positive(kind: type[float] | type[int], what: str) -> Any:
    """An argparse type: a finite number above zero, or a one-line error naming ``what``
    (also applied to a default from the environment, so a bad one is refused the same way)."""
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be {what} above 0, got {text!r}")
        return value
    return parse


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="python -m consumer_sdk.jobs",
        description="Runs and jobs: read dead letters and runs, requeue, reconcile, clean up.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", default=_env_default("--dsn", env), help=f"PostgreSQL DSN (env {ENV_DSN})")
    common.add_argument("--json", action="store_true", help="one JSON object per line")
    top = parser.add_subparsers(dest="area", required=True)
    dead = top.add_parser("dead-letters", help="jobs that ended in 'failed'").add_subparsers(
        dest="action", required=True)
    listing = dead.add_parser("list", parents=[common], help="newest first")
    listing.add_argument("--queue", default=_env_default("--queue", env), help=f"(env {env_name('--queue')})")
    listing.add_argument("--limit", type=_positive(int, "a whole number"),
                         default=_env_default("--limit", env) or "50", help=f"(env {env_name('--limit')})")
    show = dead.add_parser("show", parents=[common], help="one job's dead letter")
    show.add_argument("job_id", type=int)
    requeue = dead.add_parser("requeue", parents=[common], help="queue the job again, fresh attempts")
    requeue.add_argument("job_id", type=int)
    runs = top.add_parser("runs", help="runs").add_subparsers(dest="action", required=True)
    run_show = runs.add_parser("show", parents=[common], help="a run's status")
    run_show.add_argument("run_id")
    reconcile = top.add_parser("reconcile", parents=[common], help="one reconciler pass")
    reconcile.add_argument("--queues", default=_env_default("--queues", env),
                           help=f"comma-separated (default: {INTERACTIVE}, {BULK} and every queue with "
                                f"unfinished jobs) (env {env_name('--queues')})")
    cleanup = top.add_parser("cleanup", parents=[common], help="retention of finished runs and jobs")
    older = _env_default("--older-than-days", env)
    # Above zero: -1 (or 0) deleted every finished run, and its request key, at once.
    cleanup.add_argument("--older-than-days", type=_positive(float, "a number of days"),
                         required=older is None, default=older,
                         help="keep longer than any client retries a request (request keys go too) "
                              f"(env {env_name('--older-than-days')})")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout,
         env: Mapping[str, str] | None = None) -> int:
    where = first_undecodable(sys.argv[1:] if argv is None else argv,
                              os.environ if env is None else env, ENV_PREFIX)
    if where is not None:  # psycopg would have raised a traceback on it
        print(f"error: {where} is not valid UTF-8 text", file=sys.stderr)
        return ConfigError.exit_code
    args = build_parser(env).parse_args(argv)
    if not args.dsn:
        print(f"error: --dsn or ${ENV_DSN} is required", file=sys.stderr)
        return ConfigError.exit_code
    if args.area == "reconcile" and args.queues is not None:  # '' reconciled no queue, exit 0
        bad = [name for name in args.queues.split(",") if not QUEUE_NAME.match(name)]
        if bad:
            print(f"error: --queues / {env_name('--queues')}: {', '.join(map(repr, bad))} is not a "
                  "queue name (1-64 of [A-Za-z0-9_.:-], comma-separated)", file=sys.stderr)
            return ConfigError.exit_code
    try:
        validate_dsn(args.dsn, option=f"--dsn / {ENV_DSN}")
        with _pg.connect(args.dsn, application_name="outbox-jobs-cli", connect_timeout_s=10) as conn:
            return _run(conn, args, out)
    except OutboxSdkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except psycopg.OperationalError as exc:  # the connection broke during the command
        print(f"error: database unavailable: {mask_text(str(exc).strip().splitlines()[0])}", file=sys.stderr)
        return OutboxSdkError.exit_code


def _run(conn: psycopg.Connection[Any], args: argparse.Namespace, out: TextIO) -> int:
    if args.area == "dead-letters" and args.action in ("list", "show"):
        records = admin.dead_letters(conn, queue=getattr(args, "queue", None),
                                     job_id=getattr(args, "job_id", None),
                                     limit=getattr(args, "limit", 1))
        for record in records:
            print(_json(asdict(record)) if args.json else _text(record), file=out)
        if not records and args.action == "show":
            print(f"job {args.job_id} has no dead letter", file=out)
            return 1
        return 0
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
    queues = (args.queues.split(",") if args.queues is not None
              else sorted({INTERACTIVE, BULK, *active_queues(conn)}))
    result = Reconciler(queues=queues).run_once(conn)
    print(_json(asdict(result)), file=out)
    return 0


def _text(r: DeadLetterRecord) -> str:
    return (f"job {r.job_id} ({r.queue}/{r.kind}, run {r.run_id}) dead at {r.dead_at:%Y-%m-%d %H:%M:%S%z}\n"
            f"  reason:   {r.reason} after {r.attempts} attempt(s)\n"
            f"  error:    {r.error}\n"
            f"  trace_id: {r.trace_id or '-'}")


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)
