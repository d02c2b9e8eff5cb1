"""One set of conventions across the relay's CLI, the jobs CLI and the SDK's config objects:
the same error classes and exit codes, the same environment rule, the same option names."""

from __future__ import annotations

import io
import warnings
from dataclasses import fields

import pytest

import consumer_sdk.errors as sdk_errors
import relay.errors as relay_errors
from consumer_sdk.jobs import WorkerConfig
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
    assert jobs_cli.main(["runs", "show", "x", "--dsn", unreachable], out=io.StringIO(), env={}) == 1
    assert jobs_cli.main(["runs", "show", "x", "--dsn", "postgresql://u:pw@127.0.0.1:notaport/d"],
                         out=io.StringIO(), env={}) == 2
    assert jobs_cli.main(["runs", "show", "x"], out=io.StringIO(), env={}) == 2
    assert "pw@" not in capsys.readouterr().err
