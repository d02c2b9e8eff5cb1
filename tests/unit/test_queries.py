from __future__ import annotations

import re

import pytest

from outbox_core.queries import resolve_includes
from relay.migrate import migrations, render
from relay.queries import load, parse_blocks, query


def test_parse_blocks_splits_named_queries() -> None:
    text = "-- header\n-- name: one\nSELECT 1\n\n-- name: two\n-- why\nSELECT 2\n"
    assert parse_blocks(text) == {"one": "SELECT 1", "two": "-- why\nSELECT 2"}


@pytest.mark.parametrize("group", ["relay", "leases", "admin", "jobs", "inbox"])
def test_statements_are_sent_without_their_comment_lines(group) -> None:
    for name, sql in load(group).items():
        assert not [line for line in sql.splitlines() if line.lstrip().startswith("--")], name


def test_the_claim_is_short_enough_for_psycopgs_conversion_cache() -> None:
    """psycopg caches the conversion of placeholders only for statements up to 4 KiB:
    a claim over that was converted again at every claim (a third of the relay's CPU
    at a steady 100 events/s)."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    assert len(query("relay", "claim_batch").encode()) <= MAX_CACHED_STATEMENT_LENGTH


def test_an_include_line_stands_for_the_named_block() -> None:
    blocks = parse_blocks("-- name: fence\nSELECT s FROM t\n-- name: a\nWITH h AS (\n"
                          "    -- include: fence\n)\nSELECT * FROM h\n"
                          "-- name: b\n-- include: a\n")
    resolved = resolve_includes(blocks)
    assert resolved["a"] == "WITH h AS (\nSELECT s FROM t\n)\nSELECT * FROM h"
    assert resolved["b"] == resolved["a"]  # included blocks are themselves resolved
    assert resolved["fence"] == "SELECT s FROM t"


def test_an_include_of_nothing_or_of_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="'a' includes 'gone', which does not exist"):
        resolve_includes(parse_blocks("-- name: a\n-- include: gone\n"))
    with pytest.raises(ValueError, match="includes itself: a -> b -> a"):
        resolve_includes(parse_blocks("-- name: a\n-- include: b\n-- name: b\n-- include: a\n"))


@pytest.mark.parametrize("group", ["relay", "leases", "admin", "jobs", "inbox", "replay"])
def test_no_statement_keeps_an_include_line(group) -> None:
    for name, text in load(group).items():
        assert "include:" not in text, name


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        parse_blocks("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")


@pytest.mark.parametrize("group", ["relay", "leases", "admin"])
def test_every_query_uses_named_parameters_only(group) -> None:
    for name, sql in load(group).items():
        body = re.sub(r"%%", "", sql)
        stray = re.findall(r"%(?!\([a-z_]+\)s)", body)
        assert not stray, f"{group}.{name} has a % that is not a named placeholder"


def test_missing_query_is_named() -> None:
    with pytest.raises(KeyError, match="no query 'nope'"):
        query("relay", "nope")


def test_migrations_are_numbered_without_gaps_and_print() -> None:
    found = migrations()
    assert [m.version for m in found] == list(range(1, len(found) + 1))
    script = render(8)
    for m in found:
        assert m.path.name in script
    assert "VALUES (true, 8)" in script
    # The claim's index for that count, replacing 0001's on PostgreSQL 17 and later
    # (relay/migrate.py, claim_index): last, a psycopg block's %% printed as SQL's %.
    tail = script[script.index("-- ==== the claim's index for 8 shards ===="):]
    assert "IF current_setting('server_version_num')::int >= 170000 THEN" in tail
    assert 'CREATE INDEX IF NOT EXISTS "outbox_pending_by_8_shards_idx"' in tail
    assert "& 2147483647) % 8))\n    WHERE published_at IS NULL;" in tail
    assert "DROP INDEX IF EXISTS outbox_pending_idx;" in tail and tail.rstrip().endswith("$$;")
    assert script.splitlines()[1] == "SET lock_timeout = '5000ms';"  # as migrate's default
    assert "SET lock_timeout = '1500ms';" in render(8, lock_timeout_s=1.5)
