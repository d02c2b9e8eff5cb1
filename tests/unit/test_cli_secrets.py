"""What argparse quotes back shows no password: a DSN given without ``--dsn``, after a
misspelt flag or in place of a sub-command was echoed whole in the one-line error (found
by an audit of the relay's command line; each case failed on the code before)."""

from __future__ import annotations

import io

import pytest

from consumer_sdk.jobs import cli as jobs_cli
from relay import cli

DSN = "postgresql://relay:S3cr3tPw@127.0.0.1:1/app"


@pytest.mark.parametrize("argv", [
    ["status", DSN],  # unrecognized arguments
    ["status", "--dns", DSN],  # a misspelt flag
    ["dead-letters", "--dsn", DSN, "list"],  # ... the DSN taken for the action
    ["dead-letters", DSN],
    ["replay", "cancel", DSN],  # invalid int value
    [DSN],  # invalid command
    ["host=db password=S3cr3tPw"],
])
def test_the_relay_cli_masks_a_dsn_it_quotes_in_an_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv, env={})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "S3cr3tPw" not in err, err


@pytest.mark.parametrize("argv", [["cleanup", DSN], [DSN], ["reconcile", "--dns", DSN]])
def test_the_jobs_cli_masks_a_dsn_it_quotes_in_an_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        jobs_cli.main(argv, out=io.StringIO(), env={})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "S3cr3tPw" not in err, err
