"""Package rules: named SQL only, never the relay package, metrics under one prefix, typed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import consumer_sdk
from consumer_sdk.metrics import ConsumerMetrics
from outbox_core import queries as _sql

PACKAGE = Path(consumer_sdk.__file__).resolve().parent
SOURCES = sorted(PACKAGE.glob("*.py"))


def _calls_to_query(tree: ast.AST) -> list[tuple[str, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "query":
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if len(args) == 2:
                found.append((args[0], args[1]))
    return found


def test_every_named_query_the_sdk_uses_exists():
    used = {pair for path in SOURCES for pair in _calls_to_query(ast.parse(path.read_text()))}
    # waits: the catalog read of what a session waits on, shared with the relay (inbox_waits.py)
    assert {g for g, _ in used} == {"inbox", "sdk_outbox", "waits"}
    for group, name in used:
        assert _sql.query(group, name).strip(), (group, name)


def test_the_sdk_never_imports_the_relay():
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("relay") for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("relay"), path


def test_no_sql_strings_in_python():
    sql = re.compile(r"\b(SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM)\b")
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert not sql.search(node.value), f"{path.name}: {node.value[:60]!r}"


def test_query_loader_rejects_duplicates_and_names_missing_queries():
    with pytest.raises(ValueError):
        _sql.parse_blocks("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")
    with pytest.raises(KeyError, match="nope"):
        _sql.query("inbox", "nope")
    assert (_sql.sql_files() / "migrations" / "0004_inbox.sql").is_file()


def test_metrics_share_one_prefix():
    metrics = ConsumerMetrics()
    names = {m.name for m in metrics.registry.collect()}
    assert names and all(n.startswith("outbox_consumer_") for n in names)
    assert {"outbox_consumer_processed", "outbox_consumer_duplicates_dropped", "outbox_consumer_handler_errors",
            "outbox_consumer_dead_lettered", "outbox_consumer_batch_duration_seconds",
            "outbox_consumer_lag_messages"} <= names


def test_typed_package():
    assert (PACKAGE / "py.typed").is_file()
    assert set(consumer_sdk.__all__) <= set(dir(consumer_sdk))
