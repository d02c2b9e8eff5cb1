"""The SQL the runbooks and the README quote runs on a migrated database.

An operator copies these statements during an incident: a wrong column or table name
costs minutes when they are most expensive.  Every statement quoted in
deploy/runbooks/*.md and README.md (inline code spans and fenced blocks that begin with an
upper-case SQL keyword) is checked against a fresh database migrated by `relay.migrate`
(the relay's tables and the SDK's inbox and jobs tables), by kind:

- SELECT, WITH, INSERT, UPDATE, DELETE: `EXPLAIN <statement>` plans without running, so the
  names of tables, columns, functions and types are resolved but nothing is read, written
  or terminated (`pg_terminate_backend(<pid>)` is planned, never called);
- SHOW, SET, LOCK, ALTER ROLE: run inside a transaction that is always rolled back (they
  are transactional; LOCK and ALTER ROLE cannot be EXPLAINed);
- VACUUM, ANALYZE: run for real, on this test's own, empty database (VACUUM refuses a
  transaction block; on empty tables it takes milliseconds);
- BEGIN, COMMIT: transaction control around an example, nothing to resolve.
Any other kind (CREATE, DROP, ALTER TABLE, GRANT, ...) fails until it is given a check or
a SKIP entry with a reason, so a new kind of quote cannot pass unchecked.

Prose that names a command rather than quoting one (`LOCK TABLE`, `VACUUM FULL`, `SELECT
... FOR UPDATE`: only upper-case words, or an ellipsis `...` outside quotes) is not a
statement.  Placeholders operators fill in are replaced by typed samples (PLACEHOLDERS);
an unknown `<...>` fails, naming it; a `'...'`, `$1` or `:name` fails in PostgreSQL (no
such parameter, not a uuid, ...) until PLACEHOLDERS gives it a sample.  Statements that
cannot run here (the application's own tables, a partitioned outbox's partitions) are in
SKIP with the reason, and left out of the check.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import migrate

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((ROOT / "deploy" / "runbooks").glob("*.md")), ROOT / "README.md"]

# What operators fill in -> a sample of the right type (the text around it keeps its quotes).
PLACEHOLDERS = {
    "<consumer>": "billing",  # inside 'outbox-consumer:<consumer>' or '<consumer>': text
    "<event_id>": "0190a0c2-0000-7000-8000-000000000001",  # inside quotes: a uuid literal
    "<pid from the log>": "12345",  # a backend pid: integer
    "<relay pid>": "12345",
    "<pid>": "12345",
    "<job_id>": "42",  # jobs.id: bigint
    "<row_id>": "42",  # outbox.id: bigint
    "<queue>": "bulk",  # inside quotes: text
    "<worker_id>": "worker-1",  # inside quotes: text
    "<role>": "CURRENT_USER",  # ALTER ROLE <role>: the role running the relay
    "ALTER ROLE relay SET": "ALTER ROLE CURRENT_USER SET",  # README's example role `relay`
}

# Statements (whitespace collapsed) that are not checked here, and why.
SKIP = {
    "UPDATE orders SET status = 'paid' WHERE id = 17":
        "the application's own table in the README's example transaction",
    "ALTER TABLE outbox DETACH PARTITION":
        "names the command (no partition); only a partitioned outbox has partitions",
}

# README statements known not to run -> the corrected wording, kept green until README.md is
# changed (then the entry goes).  Empty: every README statement ran when this was written.
# A failing runbook statement is fixed in the runbook instead, never listed here.
EXPECTED_BROKEN: dict[str, str] = {}

EXPLAINED = ("SELECT", "WITH", "INSERT", "UPDATE", "DELETE")
ROLLED_BACK = ("SHOW", "SET", "LOCK", "ALTER ROLE")
AUTOCOMMIT = ("VACUUM", "ANALYZE")
TRANSACTION_CONTROL = ("BEGIN", "COMMIT")
KEYWORD = re.compile(r"(?:SELECT|WITH|INSERT|UPDATE|DELETE|EXPLAIN|VACUUM|ANALYZE|SHOW|SET|RESET|"
                     r"LOCK|ALTER|GRANT|REVOKE|CREATE|DROP|TRUNCATE|REINDEX|CALL|BEGIN|COMMIT)"
                     r"(?=[\s(;]|$)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")


@dataclass(frozen=True)
class Quoted:
    """One statement as the document quotes it, and where."""

    where: str
    text: str


def _collapsed(text: str) -> str:
    return " ".join(text.split()).rstrip(";").strip()


def _is_mention(text: str) -> bool:
    """Prose naming a command: nothing but upper-case words, or an ellipsis outside quotes."""
    unquoted = re.sub(r"'[^']*'", "''", text)
    return "..." in unquoted or not re.search(r"[a-z0-9]", text)


def quoted_statements(path: Path) -> list[Quoted]:
    """The SQL statements `path` quotes, in order (a fenced block split at its semicolons)."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(ROOT).as_posix()
    found: list[tuple[int, str]] = []
    for block in FENCE.finditer(text):
        if not KEYWORD.match(block.group(1).lstrip()):
            continue
        offset = block.start(1)
        for part in re.split(r"(?<=;)", block.group(1)):
            if part.strip():
                start = offset + len(part) - len(part.lstrip())
                found.append((text.count("\n", 0, start) + 1, part))
            offset += len(part)
    outside = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in SPAN.finditer(outside):
        if KEYWORD.match(span.group(1)):
            found.append((outside.count("\n", 0, span.start()) + 1, span.group(1)))
    statements = [Quoted(f"{name}:{line}", _collapsed(body)) for line, body in sorted(found)]
    return [q for q in statements if not _is_mention(q.text)]


ALL = [q for path in SOURCES for q in quoted_statements(path)]


def filled_in(text: str) -> str:
    """`text` with every known placeholder replaced; an unknown `<...>` fails, naming it."""
    for placeholder, sample in PLACEHOLDERS.items():
        text = text.replace(placeholder, sample)
    unknown = re.findall(r"<[^<>]+>", text)
    assert not unknown, f"placeholder(s) {unknown} have no sample: add them to PLACEHOLDERS"
    return text


def problem(conn: psycopg.Connection[Any], statement: str) -> str | None:
    """What PostgreSQL says is wrong with `statement`, or None when it plans/runs."""
    kind = next((k for k in (*EXPLAINED, *ROLLED_BACK, *AUTOCOMMIT, *TRANSACTION_CONTROL)
                 if re.match(rf"{k}\b", statement)), None)
    if kind is None:
        return "no safe check for this kind of statement: give it one or a SKIP entry"
    if kind in TRANSACTION_CONTROL:
        return None
    query = sql.SQL(statement)  # the quoted text itself is what is under test
    try:
        if kind in AUTOCOMMIT:
            conn.execute(query)
        else:
            with conn.transaction(force_rollback=True):
                conn.execute(sql.SQL("EXPLAIN {}").format(query) if kind in EXPLAINED else query)
    except psycopg.Error as exc:
        return f"{type(exc).__name__}: {exc}".strip()
    return None


@pytest.fixture(scope="module")
def conn(pg_server: Any) -> Iterator[psycopg.Connection[Any]]:
    """A connection to a fresh database with all migrations applied (relay, inbox, jobs)."""
    name = f"t_runbook_sql_{uuid.uuid4().hex[:8]}"
    dsn = pg_server.create_database(name)
    try:
        migrate.apply(dsn)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("SET lock_timeout = '5s'")  # nothing else uses this database
            yield c
    finally:
        pg_server.drop_database(name)


def _test_id(index: int) -> str:
    """`file:line`, and `file:line#2` for the second statement on a line."""
    where = ALL[index].where
    nth = sum(q.where == where for q in ALL[:index]) + 1
    return where if nth == 1 else f"{where}#{nth}"


#: The statements checked: every one quoted but those SKIP names (their reasons there; the
#: extraction test fails when one is no longer quoted).  Left out, not skipped: CI reports no skip.
CHECKED = [i for i, quoted in enumerate(ALL) if quoted.text not in SKIP]


@pytest.mark.parametrize("quoted", [ALL[i] for i in CHECKED], ids=[_test_id(i) for i in CHECKED])
def test_quoted_statement_runs(conn: psycopg.Connection[Any], quoted: Quoted) -> None:
    found = problem(conn, filled_in(quoted.text))
    if quoted.text in EXPECTED_BROKEN:
        assert found, f"{quoted.where} runs now: take it out of EXPECTED_BROKEN"
        return
    assert found is None, f"{quoted.where}: `{quoted.text}` does not run: {found}"


def test_checker_catches_an_invented_column(conn: psycopg.Connection[Any]) -> None:
    """The check can fail: a column no migration creates is refused, a real one is not."""
    assert problem(conn, "SELECT queue, count(*) FROM jobs GROUP BY queue") is None
    found = problem(conn, "SELECT queue, count(*) FROM jobs WHERE leased_until < now() GROUP BY queue")
    assert found is not None and "leased_until" in found, found
    assert "no_such_table" in (problem(conn, "SELECT 1 FROM no_such_table") or "")


def test_extraction_finds_the_quoted_statements() -> None:
    """A reshaped runbook (or extractor) cannot silently empty the check."""
    in_runbooks = [q for q in ALL if q.where.startswith("deploy/runbooks/")]
    assert len(in_runbooks) >= 30, [q.where for q in in_runbooks]
    assert len(ALL) - len(in_runbooks) >= 4, [q.where for q in ALL if q not in in_runbooks]
    assert {"SELECT", "SHOW", "SET", "VACUUM", "ANALYZE", "ALTER", "LOCK", "INSERT"} <= {
        q.text.split()[0] for q in ALL}
    texts = {q.text for q in ALL}
    stale = [t for t in (*SKIP, *EXPECTED_BROKEN) if t not in texts]
    assert not stale, f"no longer quoted anywhere, remove from SKIP/EXPECTED_BROKEN: {stale}"
