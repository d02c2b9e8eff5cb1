"""One set of conventions across the relay's CLI, the jobs CLI and the SDK's config objects:
the same error classes and exit codes, the same environment rule, the same option names."""

from __future__ import annotations

import io
import uuid
import warnings
from dataclasses import fields
from pathlib import Path

import pytest

import consumer_sdk.errors as sdk_errors
import relay.errors as relay_errors
from consumer_sdk import _pg
from consumer_sdk.jobs import WorkerConfig
from consumer_sdk.jobs import admin as jobs_admin
from consumer_sdk.jobs import cli as jobs_cli
from relay.config import OPTIONS

SHARED_ERRORS = ("ConfigError", "SchemaMissing", "AuthenticationFailed", "DatabaseUnavailable", "FatalError",
                 "RetriableError")


@pytest.mark.parametrize("name", SHARED_ERRORS)
def test_the_same_error_class_means_the_same_exit_code(name: str) -> None:
    relay_cls, sdk_cls = getattr(relay_errors, name), getattr(sdk_errors, name)
    assert sdk_cls.exit_code == relay_cls.exit_code, name
    assert issubclass(sdk_cls, sdk_errors.FatalError) == issubclass(relay_cls, relay_errors.FatalError) or \
        name in ("ConfigError", "SchemaMissing")  # both fatal in effect: the SDK's predate FatalError


def test_the_worker_config_uses_the_relays_option_names() -> None:
    relay_names = {o.name for o in OPTIONS}
    worker_names = {f.name for f in fields(WorkerConfig)}
    for name in ("lease_duration_s", "heartbeat_interval_s", "drain_timeout_s", "poll_interval_s", "dsn"):
        assert name in relay_names and name in worker_names, name


def test_the_old_worker_option_names_still_work_deprecated() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = WorkerConfig(dsn="postgresql://x", lease_s=12, heartbeat_s=2)
    assert (config.lease_duration_s, config.heartbeat_interval_s, config.heartbeat_every_s) == (12, 2, 2)
    assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]


def test_every_cli_option_is_a_variable_by_the_same_rule() -> None:
    relay_rule = {o.name: o.env for o in OPTIONS}
    assert relay_rule["lease_duration_s"] == "OUTBOX_RELAY_LEASE_DURATION_S"
    assert jobs_cli.env_name("--older-than-days") == "OUTBOX_JOBS_OLDER_THAN_DAYS"
    assert jobs_cli.env_name("--dsn") == "OUTBOX_JOBS_DSN"
    parser = jobs_cli.build_parser({"OUTBOX_JOBS_OLDER_THAN_DAYS": "7", "OUTBOX_JOBS_DSN": "postgresql://h/d"})
    args = parser.parse_args(["cleanup"])
    assert (args.older_than_days, args.dsn) == (7.0, "postgresql://h/d")


@pytest.mark.parametrize(("argv", "env", "named"), [
    (["cleanup", "--older-than-days", "-1"], {}, "--older-than-days"),
    (["cleanup", "--older-than-days", "0"], {}, "--older-than-days"),
    (["cleanup"], {"OUTBOX_JOBS_OLDER_THAN_DAYS": "-1"}, "--older-than-days"),
    (["cleanup"], {"OUTBOX_JOBS_OLDER_THAN_DAYS": "abc"}, "--older-than-days"),
    (["dead-letters", "list"], {"OUTBOX_JOBS_LIMIT": "abc"}, "--limit"),
    (["dead-letters", "list", "--limit", "-1"], {}, "--limit"),
])
def test_a_bad_number_is_refused_in_one_line_before_anything_is_deleted(
        argv: list[str], env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`cleanup --older-than-days -1` (or 0, or the variable) was accepted and deleted every
    finished run at once, its request key with it; a variable that was not a number was a
    traceback when the parser was built."""
    with pytest.raises(SystemExit) as exited:
        jobs_cli.main([*argv, "--dsn", "postgresql://nobody@127.0.0.1:1/none"], out=io.StringIO(),
                      env=env)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


@pytest.mark.parametrize("queues", ["", "interactive,", "bad name", "x" * 65])
def test_reconcile_refuses_what_is_not_a_queue_name(queues: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`reconcile --queues ''` reconciled nothing and exited 0.  (Any valid name is a queue:
    tests/integration/jobs/test_jobs_admin.py reconciles one of a service's own.)"""
    code = jobs_cli.main(["reconcile", "--queues", queues, "--dsn", "postgresql://nobody@127.0.0.1:1/none"],
                         out=io.StringIO(), env={})
    assert code == 2 and "--queues" in capsys.readouterr().err


def test_the_jobs_cli_exit_codes_are_the_relays(capsys: pytest.CaptureFixture[str]) -> None:
    unreachable = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"
    run = "123e4567-e89b-12d3-a456-426614174000"  # a run id is a UUID; "x" is now refused (exit 2)
    assert jobs_cli.main(["runs", "show", run, "--dsn", unreachable], out=io.StringIO(), env={}) == 1
    assert jobs_cli.main(["runs", "show", run, "--dsn", "postgresql://u:pw@127.0.0.1:notaport/d"],
                         out=io.StringIO(), env={}) == 2
    assert jobs_cli.main(["runs", "show", run], out=io.StringIO(), env={}) == 2
    assert "pw@" not in capsys.readouterr().err


# --- bad input: one line on stderr naming the argument or the variable, exit 2, nothing done ----

UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"
A_RUN_ID = "123e4567-e89b-12d3-a456-426614174000"


@pytest.fixture
def no_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be refused before the CLI connects: a connection attempt fails the test."""
    def connect(*args: object, **kwargs: object) -> None:
        raise AssertionError("the CLI connected to the database")
    monkeypatch.setattr(_pg, "connect", connect)


def _refused(argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI expecting exit 2; its stderr, checked to be one line without a traceback."""
    code: object
    try:
        code = jobs_cli.main(argv, out=io.StringIO(), env=env)
    except SystemExit as exc:  # argparse's way out
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, captured
    err = captured.err.strip()
    assert err and "\n" not in err and "Traceback" not in err and "usage:" not in err, err
    assert captured.out == ""
    return err


@pytest.mark.parametrize(("argv", "named"), [
    # "bigint out of range" from the database, exit 1
    (["dead-letters", "list", "--limit", "99999999999999999999"], "--limit"),
    (["dead-letters", "list", "--limit", "10001"], "--limit"),
    (["dead-letters", "show", "99999999999999999999"], "JOB_ID"),
    (["dead-letters", "show", "0"], "JOB_ID"),
    (["dead-letters", "requeue", str(2**63)], "JOB_ID"),
    # "invalid input syntax for type uuid" from the database, exit 1
    (["runs", "show", "not-a-uuid"], "RUN_ID"),
    (["runs", "show", A_RUN_ID + "0"], "RUN_ID"),
    # "interval out of range" from the database, exit 1
    (["cleanup", "--older-than-days", "1e10"], "--older-than-days"),
    (["cleanup", "--older-than-days", "36501"], "--older-than-days"),
    # accepted: every run that finished a moment ago would have been deleted
    (["cleanup", "--older-than-days", "1e-300"], "--older-than-days"),
    (["cleanup", "--older-than-days", "0.04"], "--older-than-days"),
])
def test_numbers_and_ids_out_of_range_are_refused_before_the_database_sees_them(
        argv: list[str], named: str, no_connection: None, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused([*argv, "--dsn", UNREACHABLE], {}, capsys)
    assert named in err
    if "--older-than-days" in argv:
        assert "1/24 (one hour) to 36500" in err  # the range is given


@pytest.mark.parametrize(("argv", "env", "named"), [
    (["--events-topic", "bad topic"], {}, "--events-topic"),
    (["--events-topic", "."], {}, "--events-topic"),
    ([], {"OUTBOX_JOBS_EVENTS_TOPIC": "x" * 250}, "OUTBOX_JOBS_EVENTS_TOPIC"),
])
def test_reconcile_refuses_an_events_topic_the_pools_would_refuse(
        argv: list[str], env: dict[str, str], named: str, no_connection: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The topic the pools write their job events to (WorkerConfig.events_topic, a Kafka
    topic name) is checked the same way, before anything is connected to."""
    err = _refused(["reconcile", *argv, "--dsn", UNREACHABLE], env, capsys)
    assert named in err and "not a Kafka topic name" in err
    parse = jobs_cli.build_parser({"OUTBOX_JOBS_EVENTS_TOPIC": "jobs.events"}).parse_args
    assert parse(["reconcile"]).events_topic == "jobs.events"
    assert parse(["reconcile", "--events-topic", "other_topic-1"]).events_topic == "other_topic-1"  # the flag wins
    assert jobs_cli.build_parser({}).parse_args(["reconcile"]).events_topic is None


def test_the_parser_accepts_the_bounds_and_gives_a_run_id_as_a_uuid() -> None:
    parse = jobs_cli.build_parser({}).parse_args
    assert parse(["runs", "show", A_RUN_ID.upper()]).run_id == uuid.UUID(A_RUN_ID)
    assert parse(["dead-letters", "list", "--limit", "10000"]).limit == 10000
    assert parse(["dead-letters", "show", str(2**63 - 1)]).job_id == 2**63 - 1
    assert parse(["cleanup", "--older-than-days", str(1 / 24)]).older_than_days == 1 / 24
    assert parse(["cleanup", "--older-than-days", "36500"]).older_than_days == 36500.0


@pytest.mark.parametrize("env", [
    {"OUTBOX_JOBS_LIMIT": "abc"},
    {"OUTBOX_JOBS_LIMIT": "0"},
    {"OUTBOX_JOBS_LIMIT": "99999999999999999999"},
    {"OUTBOX_JOBS_OLDER_THAN_DAYS": "abc"},
    {"OUTBOX_JOBS_OLDER_THAN_DAYS": "1e-300"},
])
def test_a_bad_variable_is_one_line_naming_the_variable(
        env: dict[str, str], no_connection: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad OUTBOX_JOBS_LIMIT was reported as "argument --limit" under a usage block."""
    (variable,) = env
    area = ["cleanup"] if "DAYS" in variable else ["dead-letters", "list"]
    err = _refused([*area, "--dsn", UNREACHABLE], env, capsys)
    assert err.split(": error: ", 1)[1].startswith(variable + ":"), err
    # The flag wins: a bad variable behind a good flag is not read.
    flag = "--older-than-days" if "DAYS" in variable else "--limit"
    assert getattr(jobs_cli.build_parser(env).parse_args([*area, flag, "2"]), flag[2:].replace("-", "_")) == 2


def test_the_dsn_can_come_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """OUTBOX_RELAY_DSN_FILE had no OUTBOX_JOBS_DSN_FILE: the DSN had to sit in the environment."""
    used: list[str] = []

    def connect(dsn: str, **kwargs: object) -> None:
        used.append(dsn)
        raise sdk_errors.DatabaseUnavailable("database unavailable")
    monkeypatch.setattr(_pg, "connect", connect)
    secret = tmp_path / "dsn"
    secret.write_text("postgresql://jobs:s3cret@db.internal/jobs\n")
    code = jobs_cli.main(["runs", "show", A_RUN_ID], out=io.StringIO(), env={"OUTBOX_JOBS_DSN_FILE": str(secret)})
    assert (code, used) == (1, ["postgresql://jobs:s3cret@db.internal/jobs"])  # one trailing newline gone
    # Written on Windows: read as the relay reads OUTBOX_RELAY_DSN_FILE (its \r kept, it was
    # refused: "sslmode '***' is not one of ...", an audit of the security paths).
    secret.write_bytes(b"host=db.internal\r\ndbname=jobs sslmode=disable\r\n")
    jobs_cli.main(["runs", "show", A_RUN_ID], out=io.StringIO(), env={"OUTBOX_JOBS_DSN_FILE": str(secret)})
    assert used[-1] == "host=db.internal\ndbname=jobs sslmode=disable"
    assert "s3cret" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        jobs_cli.main(["runs", "show", "--help"], out=io.StringIO(), env={})
    assert "OUTBOX_JOBS_DSN_FILE" in capsys.readouterr().out  # --dsn's help names it


@pytest.mark.parametrize(("content", "expected"), [
    (None, "OUTBOX_JOBS_DSN_FILE: cannot read {path}: No such file or directory"),
    ("dir", "OUTBOX_JOBS_DSN_FILE: cannot read {path}: Is a directory"),
    (b"", "OUTBOX_JOBS_DSN_FILE: {path} is empty"),
    (b"\n", "OUTBOX_JOBS_DSN_FILE: {path} is empty"),
    (b"postgresql://u:s3cret\xff@h/d\n", "OUTBOX_JOBS_DSN_FILE: {path!r} is not a readable UTF-8 text file"),
])
def test_a_bad_dsn_file_is_one_line_naming_the_variable_and_the_path_never_the_content(
        content: bytes | str | None, expected: str, tmp_path: Path, no_connection: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dsn"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    err = _refused(["runs", "show", A_RUN_ID], {"OUTBOX_JOBS_DSN_FILE": str(path)}, capsys)
    assert err == "error: " + expected.format(path=str(path))
    assert "s3cret" not in err


def test_the_dsn_and_the_dsn_file_together_are_refused(tmp_path: Path, no_connection: None,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dsn"
    path.write_text("postgresql://jobs:s3cret@db.internal/jobs")
    env = {"OUTBOX_JOBS_DSN": "postgresql://other:pw2@h/d", "OUTBOX_JOBS_DSN_FILE": str(path)}
    err = _refused(["runs", "show", A_RUN_ID], env, capsys)
    assert err == "error: set one of OUTBOX_JOBS_DSN or OUTBOX_JOBS_DSN_FILE, not both"


class _NoConnection:
    def __enter__(self) -> _NoConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(("argv", "message"), [
    (["runs", "show", A_RUN_ID], f"no run {A_RUN_ID}"),
    (["dead-letters", "show", "999"], "job 999 has no dead letter"),
    (["dead-letters", "requeue", "999"], "job 999 has no dead letter"),
])
def test_not_found_is_reported_on_stderr_with_exit_1(argv: list[str], message: str,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """They went to stdout, where `--json` output is parsed; no tooling read them there."""
    monkeypatch.setattr(_pg, "connect", lambda dsn, **kwargs: _NoConnection())
    monkeypatch.setattr(jobs_cli, "run_status", lambda conn, run_id: None)
    monkeypatch.setattr(jobs_admin, "dead_letters", lambda conn, **kwargs: [])
    monkeypatch.setattr(jobs_admin, "requeue_dead", lambda conn, job_id: False)
    out = io.StringIO()
    assert jobs_cli.main([*argv, "--dsn", UNREACHABLE], out=out, env={}) == 1
    assert out.getvalue() == ""
    assert capsys.readouterr().err.strip() == message
