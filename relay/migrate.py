"""Apply (or print) the ordered migrations in ``outbox_core/sql/migrations``.

Each file is idempotent and applied in its own transaction under an advisory
lock; applied versions are recorded in ``outbox_schema_migrations`` with a
checksum, so an edited released file is reported instead of silently skipped.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from typing import Any

import psycopg
from psycopg import sql

from relay import store as store_mod
from relay.config import DEFAULT_LOCK_TIMEOUT_S
from relay.errors import ConfigError, FatalError
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
    of stalling every writer of the table queued behind it."""
    chosen = migrations(partitioned=partitioned)
    timeout = sql.SQL(query("admin", "print_lock_timeout")).format(
        timeout=sql.Literal(f"{max(1, round(lock_timeout_s * 1000))}ms"))
    parts = [f"-- outbox-relay schema, {len(chosen)} migrations\n", f"{timeout.as_string(None)}\n"]
    for m in chosen:
        parts.append(f"\n-- ==== {m.path.name} ====\n{m.sql}")
    shard_rows = sql.SQL(query("admin", "print_shards")).format(shards=sql.Literal(int(shards)))
    parts.append(f"\n-- ==== shards ====\n{shard_rows.as_string(None)}\n")
    return "".join(parts)


def apply(dsn: str, *, shards: int | None = None, partitioned: bool = False,
          log: Any = None, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
          tries: int = LOCK_TRIES) -> list[str]:
    """Apply pending migrations and make sure the shard rows exist; returns what was applied.

    ``partitioned`` creates a day-partitioned outbox; it only applies to a database
    without an outbox yet (converting a live table is a job for its owner).

    A migration that alters a live table waits for its lock at most ``lock_timeout_s``
    (every writer of the table queues behind that wait), then is rolled back and tried
    again, ``tries`` times; after the last it raises :class:`MigrationBlocked` naming
    the sessions in old transactions that hold table locks.
    """
    applied_now: list[str] = []
    conn = store_mod.connect(dsn, application_name="outbox-relay-migrate", autocommit=False)
    try:
        with store_mod.translated():
            with conn.transaction():
                conn.execute(query("admin", "migration_lock"))
                conn.execute(query("admin", "migrations_table"))
                done = {r[0]: r[2] for r in conn.execute(query("admin", "applied_migrations"))}
            if partitioned and 1 in done and not _partitioned(conn):
                raise ConfigError("--partitioned: the outbox already exists as a plain table; "
                                  "converting it is a manual migration (see README)")
            for m in migrations(partitioned=partitioned):
                if m.version in done:
                    if done[m.version] != m.checksum and log is not None:
                        log.warning("migration_changed", version=m.version, name=m.name)
                    continue
                _apply_one(conn, m, lock_timeout_s=lock_timeout_s, tries=tries, log=log)
                applied_now.append(m.path.name)
                if log is not None:
                    log.info("migration_applied", version=m.version, name=m.name)
            if partitioned:
                from relay.partitions import maintain

                conn.autocommit = True
                maintain(conn, retention_s=None)  # today and the coming days exist at once
                conn.autocommit = False
            with conn.transaction():
                conn.execute(query("admin", "migration_lock"))
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
    except psycopg.errors.InsufficientPrivilege as exc:
        raise FatalError(f"migrate needs a role that may create tables: {exc.diag.message_primary}") from None
    finally:
        conn.close()
    return applied_now


class MigrationBlocked(FatalError):
    """A migration could not take its locks: sessions in long transactions hold them.  Its
    own exit code, so that a deploy script can tell "try again later" from a broken setup."""

    exit_code = 6


def _apply_one(conn: psycopg.Connection[Any], m: Migration, *, lock_timeout_s: float, tries: int,
               log: Any) -> None:
    """One migration in its own transaction, its lock waits bounded (see :func:`apply`)."""
    timeout = {"lock_timeout": f"{max(1, round(lock_timeout_s * 1000))}ms"}
    for attempt in range(1, tries + 1):
        try:
            with conn.transaction():
                conn.execute(query("admin", "migration_lock"))  # another migrate: wait for it
                conn.execute(query("admin", "migration_lock_timeout"), timeout)
                conn.execute(m.sql.encode())  # a whole file: no parameters
                conn.execute(query("admin", "record_migration"),
                             {"version": m.version, "name": m.name, "checksum": m.checksum})
            return
        except psycopg.errors.LockNotAvailable:
            if log is not None:
                log.warning("migration_lock_wait", version=m.version, name=m.name, attempt=attempt,
                            lock_timeout_s=lock_timeout_s)
            if attempt < tries:
                time.sleep(min(attempt, 5))  # a short transaction elsewhere ends meanwhile
    with conn.transaction():
        blockers = conn.execute(query("admin", "migration_blockers"), {"older_than_s": lock_timeout_s}).fetchall()
    held = "; ".join(f"pid {pid} ({app}, {state}, transaction open {age:.0f} s)"
                     for pid, app, state, age in blockers) or "none left now: run migrate again"
    raise MigrationBlocked(
        f"migration {m.path.name} could not take its table locks within {lock_timeout_s:g} s, "
        f"{tries} times (writers waited at most that long each time). Sessions in older "
        f"transactions holding table locks: {held}. End them or let them finish, then run "
        f"migrate again (--lock-timeout-s waits longer)")


def _partitioned(conn: psycopg.Connection[Any]) -> bool:
    from relay.partitions import is_partitioned

    with conn.transaction():
        return is_partitioned(conn)


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
