"""Package rules of consumer_sdk.jobs: named SQL only, every named query exists, never the relay
package, metrics under one prefix with bounded labels; small modules (all of consumer_sdk's)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import consumer_sdk.jobs as jobs
from consumer_sdk.errors import OutboxSdkError
from consumer_sdk.jobs import JobsMetrics
from outbox_core import queries as _sql

PACKAGE = Path(jobs.__file__).resolve().parent
SOURCES = sorted(PACKAGE.glob("*.py"))
SQL = re.compile(r"\b(SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM|LISTEN|NOTIFY)\b")


def test_every_named_query_used_exists_and_every_block_is_used():
    used: set[str] = set()
    constants: set[str] = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "q":
                used |= {a.value for a in node.args if isinstance(a, ast.Constant)}
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                constants.add(node.value)
    blocks = _sql.load("jobs")
    used |= set(blocks) & constants  # names passed on to q() through a helper
    assert used <= set(blocks), used - set(blocks)
    assert set(blocks) - used == set(), "unused blocks in outbox_core/sql/queries/jobs.sql"


def test_queries_use_named_parameters_and_take_now_where_they_read_the_clock():
    for name, sql in _sql.load("jobs").items():
        body = sql.replace("%%", "")
        assert not re.findall(r"%(?!\([a-z0-9_]+\)s)", body), name
        code = "\n".join(line.split("--")[0] for line in sql.splitlines())
        bare_now = re.findall(r"(?<!, )\bnow\(\)", code)
        assert not bare_now, f"{name} reads the clock without coalesce(%(now)s, now())"


def test_the_jobs_package_never_imports_the_relay_and_has_no_sql_strings():
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("relay") for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("relay"), path
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert not SQL.search(node.value), f"{path.name}: {node.value[:60]!r}"


def test_metrics_share_one_prefix_and_never_label_by_owner():
    metrics = JobsMetrics()
    families = list(metrics.registry.collect())
    assert families and all(f.name.startswith("outbox_jobs_") for f in families)
    labels = {label for f in families for s in f.samples for label in s.labels}
    assert labels <= {"queue", "status", "reason", "cause", "step", "le"}  # step: a pass's three (RECONCILE_STEPS)
    names = {f.name for f in families}
    assert {"outbox_jobs_oldest_pending_age_seconds", "outbox_jobs_accept_to_terminal_seconds",
            "outbox_jobs_attempts", "outbox_jobs_retries", "outbox_jobs_lease_expirations",
            "outbox_jobs_dead_lettered", "outbox_jobs_workers_busy"} <= names


def test_errors_subclass_the_sdk_root_and_the_public_api_resolves():
    for name in jobs.__all__:
        assert hasattr(jobs, name), name
    for cls in (jobs.LeaseLost, jobs.AdmissionRefused, jobs.RequestKeyConflict, jobs.PermanentJobError,
                jobs.TransientJobError, jobs.InvalidJob, jobs.RunNotFound):
        assert issubclass(cls, OutboxSdkError)
    assert str(jobs.RequestKeyConflict()).startswith("This request key was already used")


def test_the_migration_is_idempotent_by_construction():
    text = (_sql.sql_files() / "migrations" / "0005_jobs.sql").read_text()
    for statement in re.findall(r"^CREATE (?:UNIQUE )?(TABLE|INDEX) (\w+ \w+ \w+)?", text, re.MULTILINE):
        assert statement[1].startswith("IF NOT EXISTS"), statement
    assert text.count("CREATE TRIGGER") == text.count("DROP TRIGGER IF EXISTS")
