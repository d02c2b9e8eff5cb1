"""``python -m consumer_sdk.jobs``: read dead letters and runs, requeue, reconcile, clean up.

    python -m consumer_sdk.jobs dead-letters list --dsn postgresql://... [--queue bulk] [--json]
    python -m consumer_sdk.jobs dead-letters requeue JOB_ID --dsn ...
    python -m consumer_sdk.jobs runs show RUN_ID --dsn ...
    python -m consumer_sdk.jobs reconcile --dsn ... [--queues interactive,bulk] [--events-topic jobs.events]
    python -m consumer_sdk.jobs cleanup --older-than-days 30 --dsn ...

Conventions shared with ``outbox-relay`` (README, "One set of conventions"): every
option ``--some-option`` can also come from ``OUTBOX_<PROGRAM>_SOME_OPTION``, here
``OUTBOX_JOBS_SOME_OPTION`` (the flag wins), and the DSN can come from a file named by
``OUTBOX_JOBS_DSN_FILE``; exit codes 0 done, 1 failure (not found, database unavailable),
2 usage or configuration, 3 schema missing, 4 credentials rejected.  Bad input is one line
on stderr naming the argument or the variable, exit 2, before anything is connected to.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, NoReturn, TextIO, TypeVar

import psycopg
import structlog

from consumer_sdk import _pg
from consumer_sdk.config import shown
from consumer_sdk.errors import ConfigError, OutboxSdkError
from consumer_sdk.jobs import admin
from consumer_sdk.jobs.model import BULK, INTERACTIVE, QUEUE_NAME, DeadLetterRecord, RunId
from consumer_sdk.jobs.reconciler import Reconciler, active_queues
from consumer_sdk.jobs.runs import error_reference, run_status
from consumer_sdk.model import valid_topic_name
from consumer_sdk.secrets import mask_text, validate_dsn
from outbox_core.text import first_undecodable, uuid_from_text, visible

PROG = "python -m consumer_sdk.jobs"
ENV_PREFIX = "OUTBOX_JOBS_"
ENV_DSN = ENV_PREFIX + "DSN"
ENV_DSN_FILE = ENV_DSN + "_FILE"

#: ``dead-letters list --limit``: the relay's bounds for its lists.
LIMIT_RANGE = (1, 10_000)
#: Job ids are PostgreSQL bigints (a larger one was "bigint out of range" from the database).
JOB_ID_RANGE = (1, 2**63 - 1)
#: ``cleanup --older-than-days``: from one hour (1/24 day; less is never meant, and 1e-300
#: deleted every finished run with its request key) to 100 years (36,500 days; more was
#: "interval out of range" from the database).
OLDER_THAN_DAYS_RANGE = (1 / 24, 36_500.0)
#: A DSN file larger than this is not a DSN (and /dev/zero is not read to the end).
MAX_DSN_FILE_BYTES = 64 * 1024

_T = TypeVar("_T")


def env_name(flag: str) -> str:
    """``--older-than-days`` -> ``OUTBOX_JOBS_OLDER_THAN_DAYS`` (the relay's rule, its own prefix)."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _env_default(flag: str, env: Mapping[str, str]) -> str | None:
    return env.get(env_name(flag))


class _FromEnvironment(str):
    """An option's default read from the environment: argparse converts it (with the option's
    type) only when the flag is absent, and a bad one is then reported with its variable."""


def _env_value(flag: str, env: Mapping[str, str]) -> _FromEnvironment | None:
    value = _env_default(flag, env)
    return None if value is None else _FromEnvironment(value)


class _Parser(argparse.ArgumentParser):
    """An error is one line, as the relay's (not argparse's usage block)."""

    def error(self, message: str) -> NoReturn:  # a DSN argparse quotes shows no password
        self.exit(ConfigError.exit_code, f"{self.prog}: error: {mask_text(message)} (see {self.prog} --help)\n")


def _number(kind: type[float] | type[int], what: str, bounds: tuple[float, float],
            bounds_text: str) -> Callable[[str], Any]:
    """Parse a finite number within ``bounds`` (``bounds_text`` names the range), or a
    ValueError whose text is the one-line reason."""
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:  # (or more than 4300 digits: out of range, not "not a number")
            if text.strip().lstrip("+-").isdigit():
                raise ValueError(f"must be {bounds_text}, got {shown(text)}") from None
            raise ValueError(f"not {what}: {shown(text)}") from None
        if not (math.isfinite(value) and bounds[0] <= value <= bounds[1]):
            raise ValueError(f"must be {bounds_text}, got {shown(text)}")
        return value
    return parse


def _argument(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """An argparse type of a command-line-only argument: argparse names it in its one-line error."""
    def convert(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _option(parser: argparse.ArgumentParser, flag: str, parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """An argparse type of an option that is also a variable: a bad flag is argparse's one-line
    error naming the flag; a bad variable (a default, so converted after the command line was
    read) is one line naming the variable, not "argument --flag" with a usage block."""
    def convert(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as exc:
            if isinstance(text, _FromEnvironment):
                parser.exit(ConfigError.exit_code,
                            f"{PROG}: error: {env_name(flag)}: {exc} (the variable of {flag})\n")
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _run_id(text: str) -> RunId:
    """A run id is a UUID (``runs.accept`` hands out ``uuid.UUID``); checked here, not by the
    database's "invalid input syntax for type uuid"."""
    parsed = uuid_from_text(text)
    if parsed is None:
        raise ValueError(f"not a run id (a UUID such as 123e4567-e89b-12d3-a456-426614174000): "
                         f"{shown(text)}")
    return RunId(parsed)


def _topic(text: str) -> str:
    """A Kafka topic name, as WorkerConfig.events_topic takes it."""
    if not valid_topic_name(text):
        raise ValueError(f"not a Kafka topic name (1-249 of [A-Za-z0-9._-], not '.' or '..'): {shown(text)}")
    return text


_limit = _number(int, "a whole number", LIMIT_RANGE, f"from {LIMIT_RANGE[0]} to {LIMIT_RANGE[1]}")
_job_id = _number(int, "a job id (a whole number)", JOB_ID_RANGE,
                  f"a job id from {JOB_ID_RANGE[0]} to {JOB_ID_RANGE[1]}")
_days = _number(float, "a number of days", OLDER_THAN_DAYS_RANGE,
                f"a number of days from 1/24 (one hour) to {OLDER_THAN_DAYS_RANGE[1]:.0f} (100 years)")


def read_dsn_file(env: Mapping[str, str]) -> str | None:
    """``OUTBOX_JOBS_DSN_FILE`` names a file whose content (trailing newlines stripped, as the
    relay's ``OUTBOX_RELAY_DSN_FILE``) is the DSN; None when it is not set.  A ConfigError
    names the variable and the path, never the content."""
    path = env.get(ENV_DSN_FILE)
    if not path:
        return None
    if env.get(ENV_DSN):
        raise ConfigError(f"set one of {ENV_DSN} or {ENV_DSN_FILE}, not both")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_DSN_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{ENV_DSN_FILE}: cannot read {path}: {exc.strerror or type(exc).__name__}") from None
    except ValueError:  # a NUL in the path
        raise ConfigError(f"{ENV_DSN_FILE}: {path!r} is not a readable UTF-8 text file") from None
    if len(data) > MAX_DSN_FILE_BYTES:
        raise ConfigError(f"{ENV_DSN_FILE}: {path} is larger than {MAX_DSN_FILE_BYTES} bytes, not a DSN")
    try:
        # Newlines read as the relay's Path.read_text reads them: a file written on Windows
        # kept its \r, and "sslmode=disable\r" was refused where the relay took the file.
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n").rstrip("\n")
    except ValueError:  # the content is never echoed
        raise ConfigError(f"{ENV_DSN_FILE}: {path!r} is not a readable UTF-8 text file") from None
    if not text.strip():
        raise ConfigError(f"{ENV_DSN_FILE}: {path} is empty")
    return text


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    parser = _Parser(
        prog=PROG,
        description="Runs and jobs: read dead letters and runs, requeue, reconcile, clean up.")
    common = _Parser(add_help=False)
    common.add_argument("--dsn", default=_env_default("--dsn", env),
                        help=f"PostgreSQL DSN (env {ENV_DSN}, or {ENV_DSN_FILE} naming a file that holds it)")
    common.add_argument("--json", action="store_true", help="one JSON object per line")
    top = parser.add_subparsers(dest="area", required=True)
    dead = top.add_parser("dead-letters", help="jobs that ended in 'failed'").add_subparsers(
        dest="action", required=True)
    listing = dead.add_parser("list", parents=[common], help="newest first")
    listing.add_argument("--queue", default=_env_default("--queue", env), help=f"(env {env_name('--queue')})")
    listing.add_argument("--limit", type=_option(listing, "--limit", _limit),
                         default=_env_value("--limit", env) or "50",
                         help=f"at most this many ({LIMIT_RANGE[0]}-{LIMIT_RANGE[1]}) (env {env_name('--limit')})")
    show = dead.add_parser("show", parents=[common], help="one job's dead letter")
    show.add_argument("job_id", metavar="JOB_ID", type=_argument(_job_id))
    requeue = dead.add_parser("requeue", parents=[common], help="queue the job again, fresh attempts")
    requeue.add_argument("job_id", metavar="JOB_ID", type=_argument(_job_id))
    runs = top.add_parser("runs", help="runs").add_subparsers(dest="action", required=True)
    run_show = runs.add_parser("show", parents=[common], help="a run's status")
    run_show.add_argument("run_id", metavar="RUN_ID", type=_argument(_run_id), help="the run's UUID")
    reconcile = top.add_parser("reconcile", parents=[common], help="one reconciler pass")
    reconcile.add_argument("--queues", default=_env_default("--queues", env),
                           help=f"comma-separated (default: {INTERACTIVE}, {BULK} and every queue with "
                                f"unfinished jobs) (env {env_name('--queues')})")
    # The pools' WorkerConfig.events_topic: a job the pass fails (its lease expired on its last
    # attempt) or resumes gets the job.failed or job.resumed event a pool's pass would write.
    reconcile.add_argument("--events-topic", type=_option(reconcile, "--events-topic", _topic),
                           default=_env_value("--events-topic", env),
                           help="the topic of the job events the worker pools write (their "
                                "WorkerConfig.events_topic): the jobs this pass fails or resumes get "
                                f"theirs too (default: none written) (env {env_name('--events-topic')})")
    cleanup = top.add_parser("cleanup", parents=[common], help="retention of finished runs and jobs")
    older = _env_value("--older-than-days", env)
    # Bounded: -1, 0 (or 1e-300) deleted every finished run, and its request key, at once.
    cleanup.add_argument("--older-than-days", type=_option(cleanup, "--older-than-days", _days),
                         required=older is None, default=older,
                         help="keep longer than any client retries a request (request keys go too); "
                              f"1/24 (one hour) to {OLDER_THAN_DAYS_RANGE[1]:.0f} days "
                              f"(env {env_name('--older-than-days')})")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout,
         env: Mapping[str, str] | None = None) -> int:
    where = first_undecodable(sys.argv[1:] if argv is None else argv,
                              os.environ if env is None else env, ENV_PREFIX)
    if where is not None:  # psycopg would have raised a traceback on it
        print(f"error: {where} is not valid UTF-8 text", file=sys.stderr)
        return ConfigError.exit_code
    env = os.environ if env is None else env
    args = build_parser(env).parse_args(argv)
    try:
        from_file = read_dsn_file(env)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    args.dsn = args.dsn or from_file
    if not args.dsn:
        print(f"error: --dsn, ${ENV_DSN} or ${ENV_DSN_FILE} is required", file=sys.stderr)
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
            print(f"job {args.job_id} has no dead letter", file=sys.stderr)
            return 1
        return 0
    if args.area == "dead-letters":
        done = admin.requeue_dead(conn, args.job_id)
        print(f"job {args.job_id} {'queued again' if done else 'has no dead letter'}",
              file=out if done else sys.stderr)
        return 0 if done else 1
    if args.area == "runs":
        state = run_status(conn, args.run_id)
        if state is None:
            print(f"no run {args.run_id}", file=sys.stderr)
            return 1
        print(_json({**asdict(state), "error_reference": error_reference(state)}), file=out)
        return 0
    if args.area == "cleanup":
        finished, activations = admin.cleanup(conn, older_than_s=args.older_than_days * 86400)
        print(_json({"runs_and_jobs_deleted": finished, "activations_deleted": activations}), file=out)
        return 0
    queues = (args.queues.split(",") if args.queues is not None
              else sorted({INTERACTIVE, BULK, *active_queues(conn)}))
    # Its log lines on stderr: on stdout (structlog's default) one came before the JSON.
    log = structlog.wrap_logger(structlog.PrintLogger(sys.stderr), processors=[structlog.processors.JSONRenderer()])
    result = Reconciler(queues=queues, log=log, events_topic=args.events_topic).run_once(conn)
    print(_json(asdict(result)), file=out)
    return 0


def _text(r: DeadLetterRecord) -> str:
    # The error is the handler's text: its control characters (ESC [2J, a fake line after
    # a carriage return) reached the operator's terminal as they were (an audit of the pool).
    error = visible(r.error).replace("\n", "\n            ")
    return (f"job {r.job_id} ({visible(r.queue)}/{visible(r.kind)}, run {r.run_id}) dead at "
            f"{r.dead_at:%Y-%m-%d %H:%M:%S%z}\n"
            f"  reason:   {r.reason} after {r.attempts} attempt(s)\n"
            f"  error:    {error}\n"
            f"  trace_id: {r.trace_id or '-'}")


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)
