"""Apply (or print) the ordered migrations in ``outbox_core/sql/migrations``.

Each file is idempotent and applied in its own transaction under an advisory
lock; applied versions are recorded in ``outbox_schema_migrations`` with a
checksum, so an edited released file is reported instead of silently skipped.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg import sql

from relay import db
from relay.errors import ConfigError, FatalError
from relay.options import DEFAULT_LOCK_TIMEOUT_S
from relay.partitions import is_partitioned, maintain
from relay.queries import query, sql_files

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
DEFAULT_SHARDS = 16
LOCK_TRIES = 3  # a migration's tries at its table locks (see apply)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Traversable  # a file of the installed package (importlib.resources)

    @property
    def sql(self) -> str:
        return self.path.read_text(encoding="utf-8")

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]


def migrations(*, partitioned: bool = False) -> list[Migration]:
    """The ordered migrations; with ``partitioned``, a file's ``.partitioned.sql`` variant
    replaces it where one exists."""
    found = []
    folder = sql_files() / "migrations"
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        match = _FILE.match(path.name)
        if match:
            variant = folder / f"{path.name.removesuffix('.sql')}.partitioned.sql"
            chosen = variant if partitioned and variant.is_file() else path
            found.append(Migration(int(match.group(1)), match.group(2), chosen))
    return found


def render(shards: int = DEFAULT_SHARDS, *, partitioned: bool = False,
           lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> str:
    """Everything ``migrate`` would run, as one script for other migration tools.  It starts
    by setting the session's ``lock_timeout`` (``print_lock_timeout``), as ``migrate`` does
    for each migration: a statement that cannot take its table lock in time fails instead
    of stalling every writer of the table queued behind it; and lifts a role's
    ``statement_timeout`` and idle-in-transaction timeout, as ``migrate`` does."""
    chosen = migrations(partitioned=partitioned)
    timeout = sql.SQL(query("admin", "print_lock_timeout")).format(
        timeout=sql.Literal(_lock_timeout(lock_timeout_s)))
    parts = [f"-- outbox-relay schema, {len(chosen)} migrations\n", f"{timeout.as_string(None)}\n"]
    for m in chosen:
        parts.append(f"\n-- ==== {m.path.name} ====\n{m.sql}")
    shard_rows = sql.SQL(query("admin", "print_shards")).format(shards=sql.Literal(int(shards)))
    parts.append(f"\n-- ==== shards ====\n{shard_rows.as_string(None)}\n")
    # The claim's index for the count, as migrate builds it (for a database whose count is
    # `shards`; on PostgreSQL 17 and later), and 0001's index it replaces.
    index = _pending_index_statements(shards, "print_pending_index").as_string(None).replace("%%", "%")
    parts.append(f"\n-- ==== the claim's index for {int(shards)} shards ====\n{index}\n")
    return "".join(parts)


def _lock_timeout(lock_timeout_s: float) -> str:
    """``lock_timeout_s`` as PostgreSQL's lock_timeout setting: whole milliseconds, at least 1."""
    return f"{max(1, round(lock_timeout_s * 1000))}ms"


def apply(dsn: str, *, shards: int | None = None, partitioned: bool = False,
          log: Any = None, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
          tries: int = LOCK_TRIES) -> list[str]:
    """Apply pending migrations and make sure the shard rows exist; returns what was applied.

    ``partitioned`` creates a day-partitioned outbox; it only applies to a database
    without an outbox yet (converting a live table is a job for its owner).  On an
    outbox that exists, each migration's variant follows the outbox's layout, whatever
    the flag: a plain ``migrate`` upgrades a partitioned outbox.

    The whole run holds the run lock (:func:`_hold_run_lock`): a second ``migrate``
    started meanwhile waits, then finds the work done.  Each migration also checks,
    under the per-migration lock, that nobody applied it since (an older relay's
    ``migrate`` takes only that one).

    A migration that alters a live table waits for its lock at most ``lock_timeout_s``
    (every writer of the table queues behind that wait), then is rolled back and tried
    again, ``tries`` times; after the last it raises :class:`MigrationBlocked` naming
    the sessions in old transactions that hold table locks.
    """
    applied_now: list[str] = []
    holder = db.connect(dsn, application_name="outbox-relay-migrate", autocommit=False)
    conn = db.connect(dsn, application_name="outbox-relay-migrate", autocommit=False)
    try:
        with db.translated():
            _hold_run_lock(holder, log)
            with conn.transaction():
                _locked(conn)
                conn.execute(query("admin", "migrations_table"))
            for plain, variant in zip(migrations(), migrations(partitioned=True), strict=True):
                m = _apply_one(conn, plain, variant, partitioned=partitioned, lock_timeout_s=lock_timeout_s,
                               tries=tries, log=log)
                if m is not None:
                    applied_now.append(m.path.name)
                    if log is not None:
                        log.info("migration_applied", version=m.version, name=m.name)
            with conn.transaction():
                partitioned_now = is_partitioned(conn)
            if partitioned_now:
                conn.autocommit = True
                maintain(conn, retention_s=None)  # today and the coming days exist at once
                conn.autocommit = False
            with conn.transaction():
                _locked(conn)
                _ensure_shards(conn, shards, log)
            _ensure_pending_index(conn, lock_timeout_s=lock_timeout_s, tries=tries, log=log)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise FatalError(f"migrate needs a role that may create tables: {exc.diag.message_primary}") from None
    finally:
        conn.close()
        holder.close()
    return applied_now


def _hold_run_lock(holder: psycopg.Connection[Any], log: Any) -> None:
    """Take the run lock in a transaction ``holder`` keeps open until it is closed.

    A transaction's lock, not a session's: through a transaction pooler (which `migrate`
    supports) a session lock stays on the server connection the pooler hands the next
    client, and every later `migrate` would wait for ever.  Its own key, not the
    per-migration lock's, which ``conn`` takes in each of its transactions."""
    holder.execute(query("admin", "migration_lifts_timeouts"))
    locked = holder.execute(query("admin", "migration_run_lock_try")).fetchone()
    if not (locked and locked[0]):
        if log is not None:
            log.info("migration_waiting", reason="another migrate is running; waiting for it to finish")
        holder.execute(query("admin", "migration_run_lock_wait"))
        holder.execute(query("admin", "migration_run_lock"))


def _ensure_shards(conn: psycopg.Connection[Any], shards: int | None, log: Any) -> None:
    current = conn.execute(query("relay", "read_settings")).fetchone()
    if current is None:
        conn.execute(query("leases", "set_shards"), {"shards": shards or DEFAULT_SHARDS})
        conn.execute(query("leases", "create_shards"), {"shards": shards or DEFAULT_SHARDS})
    elif shards is not None and shards != current[0]:
        _reshard(conn, current[0], shards)
        if log is not None:  # said: it printed only "migrations applied: none"
            log.info("shards_changed", old=current[0], new=shards)
    else:
        conn.execute(query("leases", "create_shards"), {"shards": current[0]})


#: The first PostgreSQL whose btree scans keep their order with an "= ANY" test on a later
#: column: the claim's index carries the shard from there on (admin.sql, pending_index_xid_id).
SHARD_COLUMN_SINCE = 170000
#: Migration 0001's index of the pending rows by (xid, id): the claim's before PostgreSQL 17.
XID_ID_INDEX = "outbox_pending_idx"
R = TypeVar("R")


class _Step(NamedTuple):
    """What a transaction of :func:`_bounded` runs, as migrate's errors and its
    ``migration_lock_wait`` log line name it."""

    what: str  # "migration 0010_cheaper_checks.sql", "the claim's index for the shard count"
    version: int | None  # a migration's level
    name: str

    def cancelled(self) -> str:
        return self.what if self.version is None else f"{self.what} (level {self.version})"


#: The claim's index (:func:`_ensure_pending_index`), as a step of migrate's.
PENDING_INDEX_STEP = _Step("the claim's index for the shard count", None, "pending_index")


def pending_index(shards: int) -> str:
    """The claim's index for ``shards`` shards (admin.sql, pending_index_create)."""
    return f"outbox_pending_by_{int(shards)}_shards_idx"


def claim_index(server_version: int, shards: int) -> str:
    """The claim's index migrate keeps on a server of ``server_version`` (server_version_num)."""
    return pending_index(shards) if server_version >= SHARD_COLUMN_SINCE else XID_ID_INDEX


def _pending_index_statements(shards: int, block: str = "pending_index_create") -> sql.Composed:
    return sql.SQL(query("admin", block)).format(
        index=sql.Identifier(pending_index(shards)), shards=sql.Literal(int(shards)))


def _ensure_pending_index(conn: psycopg.Connection[Any], *, lock_timeout_s: float, tries: int,
                          log: Any) -> None:
    """The claim's index for the database's shard count, and no other: built when missing
    (a new database, an upgrade from before it, ``--shards`` changed), then 0001's and other
    counts' dropped, in one transaction under migrate's lock_timeout (see :func:`apply`).
    Before PostgreSQL 17 it is 0001's (xid, id) index (see :data:`SHARD_COLUMN_SINCE`)."""
    def build() -> tuple[str, list[str]] | None:
        (shards,) = conn.execute(query("relay", "read_settings")).fetchone() or (DEFAULT_SHARDS,)
        keep = claim_index(conn.info.server_version, shards)
        found = [r[0] for r in conn.execute(query("admin", "pending_indexes"))]
        others = [name for name in found if name != keep]
        if keep in found and not others:
            return None
        conn.execute(query("admin", "migration_lock_timeout"), {"lock_timeout": _lock_timeout(lock_timeout_s)})
        if keep == XID_ID_INDEX:
            conn.execute(query("admin", "pending_index_xid_id"))
        else:
            conn.execute(_pending_index_statements(shards), {})  # {}: its %% is read as %
        for name in others:
            conn.execute(sql.SQL(query("admin", "drop_index")).format(index=sql.Identifier(name)))
        return keep, others

    built = _bounded(conn, build, step=lambda: PENDING_INDEX_STEP, lock_timeout_s=lock_timeout_s,
                     tries=tries, log=log)
    if built is not None and log is not None:
        log.info("pending_index_built", index=built[0], dropped=built[1])


def _bounded(conn: psycopg.Connection[Any], body: Callable[[], R], *, step: Callable[[], _Step],
             lock_timeout_s: float, tries: int, log: Any) -> R:
    """``body``'s result, run in a transaction of migrate's (:func:`_locked`) whose lock waits
    are bounded (see :func:`apply`): rolled back and run again ``tries`` times while a table
    lock is not available, then :class:`MigrationBlocked` naming the sessions that hold them;
    a statement the server cancels is :class:`MigrationCancelled`.  ``step()`` names what
    runs, as it stands now (a migration's file follows the outbox's layout)."""
    for attempt in range(1, tries + 1):
        try:
            with conn.transaction():
                _locked(conn)  # another migrate (an older relay's): wait for it
                return body()
        except psycopg.errors.QueryCanceled as exc:
            raise MigrationCancelled(_cancelled(step().cancelled(), exc.diag.message_primary or str(exc))) from None
        except psycopg.errors.LockNotAvailable:
            if log is not None:
                now = step()
                log.warning("migration_lock_wait", version=now.version, name=now.name, attempt=attempt,
                            lock_timeout_s=lock_timeout_s)
            if attempt < tries:
                time.sleep(min(attempt, 5))  # a short transaction elsewhere ends meanwhile
    raise _blocked(conn, step().what, lock_timeout_s=lock_timeout_s, tries=tries)


class MigrationBlocked(FatalError):
    """A migration could not take its locks: sessions in long transactions hold them.  Its
    own exit code, so that a deploy script can tell "try again later" from a broken setup."""

    exit_code = 6


class MigrationCancelled(MigrationBlocked):
    """The server cancelled a migration's statement (it was rolled back): run migrate again
    once whatever cancelled it lets it be.  Exit 6 too: "try again later"."""


def _locked(conn: psycopg.Connection[Any]) -> None:
    """Begin a transaction of migrate's: the application's timeouts lifted, the
    per-migration lock taken (waited for: another migrate runs one)."""
    conn.execute(query("admin", "migration_lifts_timeouts"))
    conn.execute(query("admin", "migration_lock"))


def _cancelled(what: str, cause: str) -> str:
    """One line: which migration (``what``), what cancelled it, what to do."""
    if "statement timeout" in cause:
        advice = ("a statement_timeout cancelled it: run migrate with a role, or a DSN option, that "
                "lifts it (options=-c statement_timeout=0)")
    else:
        advice = ("an operator (pg_cancel_backend) or a tool that cancels long statements (a pooler's "
                "query_timeout) cancelled it: let it run")
    return (f"{what} was cancelled ({cause}) and rolled back; "
            f"the levels before it stay applied. {advice}, then run migrate again")


def _apply_one(conn: psycopg.Connection[Any], plain: Migration, variant: Migration, *, partitioned: bool,
               lock_timeout_s: float, tries: int, log: Any) -> Migration | None:
    """One migration in its own transaction, its lock waits bounded (see :func:`apply`);
    None when it was applied already.  Decided under the per-migration lock: the file
    (``plain`` or its partitioned ``variant``) follows the outbox's layout as it is now."""
    m = plain

    def migrate_one() -> Migration | None:
        nonlocal m
        m = _chosen(conn, plain, variant, partitioned=partitioned)
        recorded = conn.execute(query("admin", "migration_checksum"), {"version": m.version}).fetchone()
        if recorded is not None:
            if recorded[0] != m.checksum and log is not None:
                log.warning("migration_changed", version=m.version, name=m.name)
            return None
        conn.execute(query("admin", "migration_lock_timeout"), {"lock_timeout": _lock_timeout(lock_timeout_s)})
        conn.execute(m.sql.encode())  # a whole file: no parameters
        conn.execute(query("admin", "record_migration"),
                     {"version": m.version, "name": m.name, "checksum": m.checksum})
        return m

    return _bounded(conn, migrate_one, step=lambda: _Step(f"migration {m.path.name}", m.version, m.name),
                    lock_timeout_s=lock_timeout_s, tries=tries, log=log)


def _blocked(conn: psycopg.Connection[Any], what: str, *, lock_timeout_s: float, tries: int) -> MigrationBlocked:
    """``what`` could not take its table locks ``tries`` times: the error naming the sessions
    in older transactions that hold them."""
    with conn.transaction():
        blockers = conn.execute(query("admin", "migration_blockers"), {"older_than_s": lock_timeout_s}).fetchall()
    held = "; ".join(f"pid {pid} ({app}, {state}, transaction open {age:.0f} s)"
                     for pid, app, state, age in blockers) or "none left now: run migrate again"
    return MigrationBlocked(
        f"{what} could not take its table locks within {lock_timeout_s:g} s, "
        f"{tries} times (writers waited at most that long each time). Sessions in older "
        f"transactions holding table locks: {held}. End them or let them finish, then run "
        f"migrate again (--lock-timeout-s waits longer)")


def _layout(conn: psycopg.Connection[Any]) -> str:
    """The outbox's layout now: ``none`` (no outbox yet), ``plain`` or ``partitioned``."""
    row = conn.execute(query("partitions", "outbox_layout")).fetchone()
    return str(row[0]) if row else "none"


def _chosen(conn: psycopg.Connection[Any], plain: Migration, variant: Migration, *,
            partitioned: bool) -> Migration:
    """The file to apply: the layout of the outbox that exists, else the one asked for.
    ``--partitioned`` on a plain outbox (made earlier, or by a plain `migrate` that won
    the race to an empty database) is refused in one line."""
    layout = _layout(conn)
    if layout == "plain" and partitioned:
        raise ConfigError("--partitioned: the outbox already exists as a plain table (an earlier or "
                          "concurrent `migrate` made it); --partitioned needs a database without an "
                          "outbox: converting it is a manual migration (see README)")
    return variant if layout == "partitioned" or (layout == "none" and partitioned) else plain


def _reshard(conn: psycopg.Connection[Any], old: int, new: int) -> None:
    """Change the shard count; refused while any relay holds a live lease.

    Rows carry no shard (it is computed from the key at claim time), so with
    every relay stopped there is nothing in flight and nothing to move.
    """
    (live,) = conn.execute(query("leases", "live_leases"), {"now": None}).fetchone() or (0,)
    if live:
        raise ConfigError(
            f"cannot change the shard count from {old} to {new} while {live} shard lease(s) are live: "
            "stop every relay (or wait one lease duration after they stopped), then run migrate --shards again"
        )
    conn.execute(query("leases", "set_shards"), {"shards": new})
    conn.execute(query("leases", "drop_extra_shards"), {"shards": new})
    conn.execute(query("leases", "create_shards"), {"shards": new})
