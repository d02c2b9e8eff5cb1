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

from relay import adopt_index, db
from relay.errors import ConfigError, FatalError
from relay.migrate_index import SHARD_COLUMN_SINCE as SHARD_COLUMN_SINCE
from relay.migrate_index import XID_ID_INDEX as XID_ID_INDEX
from relay.migrate_index import claim_index as claim_index
from relay.migrate_index import ensure as ensure_pending_index
from relay.migrate_index import pending_index as pending_index
from relay.migrate_index import statements as pending_index_statements
from relay.migrate_steps import MigrationBlocked as MigrationBlocked
from relay.migrate_steps import MigrationCancelled as MigrationCancelled
from relay.migrate_steps import Step, bounded, lock_timeout_setting, locked
from relay.options import DEFAULT_INDEX_WAIT_S, DEFAULT_LOCK_TIMEOUT_S
from relay.partitions import is_partitioned, maintain
from relay.queries import query, sql_files

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
DEFAULT_SHARDS = 16
LOCK_TRIES = 3  # a migration's tries at its table locks (see apply)
RUN_LOCK_POLL_S = 0.25  # a second migrate tries the run lock this often (see _hold_run_lock)


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
        timeout=sql.Literal(lock_timeout_setting(lock_timeout_s)))
    parts = [f"-- outbox-relay schema, {len(chosen)} migrations\n", f"{timeout.as_string(None)}\n"]
    for m in chosen:
        parts.append(f"\n-- ==== {m.path.name} ====\n{m.sql}")
    shard_rows = sql.SQL(query("admin", "print_shards")).format(shards=sql.Literal(int(shards)))
    parts.append(f"\n-- ==== shards ====\n{shard_rows.as_string(None)}\n")
    # The claim's index for the count, as migrate builds it (for a database whose count is
    # `shards`; on PostgreSQL 17 and later), and 0001's index it replaces.
    index = pending_index_statements(shards, "print_pending_index").as_string(None).replace("%%", "%")
    concurrently = pending_index_statements(shards, concurrently=True).as_string(None).replace("%%", "%")
    parts.append(f"\n-- ==== the claim's index for {int(shards)} shards ====\n"
                 "-- Built here as in a transaction: it holds the outbox's writers while it reads the whole\n"
                 "-- table.  On an outbox of more than a few MB (on PostgreSQL 17 and later), build it first,\n"
                 "-- outside a transaction, as migrate does (relay/migrate_index.py; a partitioned outbox: ON ONLY\n"
                 "-- the outbox, then each partition's part CONCURRENTLY, attached):\n"
                 + "".join(f"--   {line}\n" for line in concurrently.strip().splitlines())
                 + f"{index}\n")
    return "".join(parts)


def apply(dsn: str, *, shards: int | None = None, partitioned: bool = False,
          log: Any = None, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
          tries: int = LOCK_TRIES, index_wait_s: float = DEFAULT_INDEX_WAIT_S) -> list[str]:
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
    the sessions in old transactions that hold table locks.  The claim's index, built
    CONCURRENTLY on a large outbox (writers go on), waits for older transactions at most
    ``index_wait_s`` in all (relay/migrate_index.py); so are the claim indexes of the tables
    ``migrate --debezium-table`` adopted (relay/adopt_index.py).
    """
    applied_now: list[str] = []
    # Never prepared: migrate works through a transaction pooler (see db.connect).
    holder = db.connect(dsn, application_name="outbox-relay-migrate", autocommit=False, prepare=False)
    conn = db.connect(dsn, application_name="outbox-relay-migrate", autocommit=False, prepare=False)
    try:
        with db.translated():
            _hold_run_lock(holder, log)
            with conn.transaction():
                locked(conn)
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
                locked(conn)
                _ensure_shards(conn, shards, log)
            ensure_pending_index(conn, dsn, lock_timeout_s=lock_timeout_s, tries=tries, log=log,
                                 wait_s=index_wait_s)
            adopt_index.ensure_all(conn, dsn, lock_timeout_s=lock_timeout_s, tries=tries, wait_s=index_wait_s,
                                   log=log)
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
    per-migration lock's, which ``conn`` takes in each of its transactions.

    Waited for by trying every :data:`RUN_LOCK_POLL_S`, not by a blocking wait: a session
    in a statement holds a snapshot, and the first migrate's CREATE INDEX CONCURRENTLY
    (relay/migrate_index.py) waits for every older snapshot to go, so it waited for the
    second migrate, which waited for it, until its watch gave up.  Between tries the
    holder's transaction holds no snapshot, and no lock wait a role's lock_timeout ends."""
    holder.execute(query("admin", "migration_lifts_timeouts"))
    if _run_lock_taken(holder):
        return
    if log is not None:
        log.info("migration_waiting", reason="another migrate is running; waiting for it to finish")
    while not _run_lock_taken(holder):
        time.sleep(RUN_LOCK_POLL_S)


def _run_lock_taken(holder: psycopg.Connection[Any]) -> bool:
    row = holder.execute(query("admin", "migration_run_lock_try")).fetchone()
    return bool(row and row[0])


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
        conn.execute(m.sql.encode())  # a whole file: no parameters
        conn.execute(query("admin", "record_migration"),
                     {"version": m.version, "name": m.name, "checksum": m.checksum})
        return m

    return bounded(conn, migrate_one, step=lambda: Step(f"migration {m.path.name}", m.version, m.name),
                    lock_timeout_s=lock_timeout_s, tries=tries, log=log)


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
