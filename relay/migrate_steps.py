"""How migrate runs each of its steps (a migration, the claim's index): in a transaction of its
own whose lock waits are bounded, tried again while a table lock is not available, and the
errors that say which step could not run and what to do (relay/migrate.py, relay/migrate_index.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import psycopg

from relay.errors import FatalError
from relay.queries import query

R = TypeVar("R")


def lock_timeout_setting(lock_timeout_s: float) -> str:
    """``lock_timeout_s`` as PostgreSQL's lock_timeout setting: whole milliseconds, at least 1."""
    return f"{max(1, round(lock_timeout_s * 1000))}ms"


class Step(NamedTuple):
    """What a transaction of :func:`bounded` runs, as migrate's errors and its
    ``migration_lock_wait`` log line name it."""

    what: str  # "migration 0010_cheaper_checks.sql", "the claim's index for the shard count"
    version: int | None  # a migration's level
    name: str

    def cancelled(self) -> str:
        return self.what if self.version is None else f"{self.what} (level {self.version})"


def bounded(conn: psycopg.Connection[Any], body: Callable[[], R], *, step: Callable[[], Step],
             lock_timeout_s: float, tries: int, log: Any) -> R:
    """``body``'s result, run in a transaction of migrate's (:func:`locked`) whose lock waits
    are bounded by ``lock_timeout_s`` (migration_lock_timeout, set once the per-migration lock
    is held; see :func:`relay.migrate.apply`): rolled back and run again ``tries`` times while a table
    lock is not available, then :class:`MigrationBlocked` naming the sessions that hold them;
    a statement the server cancels is :class:`MigrationCancelled`.  ``step()`` names what
    runs, as it stands now (a migration's file follows the outbox's layout)."""
    for attempt in range(1, tries + 1):
        try:
            with conn.transaction():
                locked(conn)  # another migrate (an older relay's): wait for it
                conn.execute(query("admin", "migration_lock_timeout"),
                             {"lock_timeout": lock_timeout_setting(lock_timeout_s)})
                return body()
        except psycopg.errors.QueryCanceled as exc:
            cause = exc.diag.message_primary or str(exc)
            raise MigrationCancelled(cancelled_message(step().cancelled(), cause)) from None
        except psycopg.errors.LockNotAvailable:
            if log is not None:
                now = step()
                log.warning("migration_lock_wait", version=now.version, name=now.name, attempt=attempt,
                            lock_timeout_s=lock_timeout_s)
            if attempt < tries:
                time.sleep(min(attempt, 5))  # a short transaction elsewhere ends meanwhile
    raise blocked(conn, step().what, lock_timeout_s=lock_timeout_s, tries=tries)


class MigrationBlocked(FatalError):
    """A migration could not take its locks: sessions in long transactions hold them.  Its
    own exit code, so that a deploy script can tell "try again later" from a broken setup."""

    exit_code = 6


class MigrationCancelled(MigrationBlocked):
    """The server cancelled a migration's statement (it was rolled back): run migrate again
    once whatever cancelled it lets it be.  Exit 6 too: "try again later"."""


def locked(conn: psycopg.Connection[Any]) -> None:
    """Begin a transaction of migrate's: the application's timeouts lifted, the
    per-migration lock taken (waited for: another migrate runs one)."""
    conn.execute(query("admin", "migration_lifts_timeouts"))
    conn.execute(query("admin", "migration_lock"))


def cancelled_message(what: str, cause: str) -> str:
    """One line: which migration (``what``), what cancelled it, what to do."""
    if "statement timeout" in cause:
        advice = ("a statement_timeout cancelled it: run migrate with a role, or a DSN option, that "
                "lifts it (options=-c statement_timeout=0)")
    else:
        advice = ("an operator (pg_cancel_backend) or a tool that cancels long statements (a pooler's "
                "query_timeout) cancelled it: let it run")
    return (f"{what} was cancelled ({cause}) and rolled back; "
            f"the levels before it stay applied. {advice}, then run migrate again")


def blocked(conn: psycopg.Connection[Any], what: str, *, lock_timeout_s: float, tries: int) -> MigrationBlocked:
    """``what`` could not take its table locks ``tries`` times: the error naming the sessions
    in older transactions that hold them."""
    with conn.transaction():
        blockers = conn.execute(query("admin", "migration_blockers"), {"older_than_s": lock_timeout_s}).fetchall()
    return MigrationBlocked(
        f"{what} could not take its table locks within {lock_timeout_s:g} s, "
        f"{tries} times (writers waited at most that long each time). Sessions in older "
        f"transactions holding table locks: {sessions(blockers)}. End them or let them finish, then run "
        f"migrate again (--lock-timeout-s waits longer)")


def sessions(rows: Sequence[Sequence[Any]]) -> str:
    """The sessions a step waited for (pid, application, state, age of the transaction), as
    its error names them."""
    return "; ".join(f"pid {pid} ({app}, {state}, transaction open {age:.0f} s)"
                     for pid, app, state, age in rows) or "none left now: run migrate again"


