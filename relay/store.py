"""The PostgreSQL side: claim, mark, leases (LISTEN and the wake-up lock: relay/wakeup.py).

Only this module (with relay/wire.py, which sends its claim and mark as prepared
statements, and the migration runner) talks to psycopg.  Driver errors are
translated at this seam into :mod:`relay.errors` types: a server that cannot be
reached is :class:`DatabaseUnavailable` (waited for), and so is a read-only one
(SQLSTATE 25006: a hot standby, or a failover in progress: :class:`DatabaseReadOnly`);
a server that refuses us for good (bad credentials, no such database or role) is fatal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from operator import itemgetter
from typing import Any, NoReturn

import psycopg
import psycopg.errors
from psycopg.abc import Buffer
from psycopg.rows import dict_row, tuple_row
from psycopg.types.datetime import TimestamptzLoader

from outbox_core.connect_errors import ConnectFailure, classify_connect_error, connect_timeout
from outbox_core.pooling import transaction_pooled
from relay.config import DSN_OPTION, mask_text
from relay.errors import (
    AuthenticationFailed,
    ConfigError,
    DatabaseReadOnly,
    DatabaseUnavailable,
    FatalError,
    PermissionDenied,
    SchemaBehind,
    SchemaMissing,
    StatementCancelled,
    TransactionPoolerUnsupported,
)
from relay.model import Claimed, Cursor, Lease, OutboxRow, RowId, ShardId, Token
from relay.queries import compose, query
from relay.wire import INTERNALS, Prepared

# The relay's reading of a failed connection attempt (outbox_core.connect_errors classifies it,
# for the SDK too): only an unreachable database is waited for; rejected credentials end the
# process with exit code 4 (the DSN is read once, so retrying would resend the same password);
# an invalid DSN is a ConfigError naming its option (:func:`translate_connect_error`).
_CONNECT_ERRORS: dict[ConnectFailure, type[Exception]] = {
    ConnectFailure.UNREACHABLE: DatabaseUnavailable,
    ConnectFailure.CREDENTIALS: AuthenticationFailed,
    ConnectFailure.REFUSED: FatalError,
}


def translate_connect_error(exc: psycopg.Error, dsn: str = "", *, option: str = DSN_OPTION) -> Exception:
    """The relay's error for a failed connection attempt (see ``_CONNECT_ERRORS``); a DSN
    libpq refuses, at parse or connect time, is named by ``option``, as the checks at start
    name it (relay/config.py): "invalid PostgreSQL connection string: connection is bad:
    ..." did not say where the string came from."""
    failed = classify_connect_error(exc, dsn=dsn)
    if failed.kind is ConnectFailure.INVALID_DSN:
        return ConfigError(f"{option} is not a valid PostgreSQL connection string: {failed.detail}")
    return _CONNECT_ERRORS[failed.kind](failed.message)


def connect(dsn: str, *, application_name: str = "outbox-relay", autocommit: bool = True,
            connect_timeout_s: int = 5, option: str = DSN_OPTION) -> psycopg.Connection[Any]:
    """A new connection, errors translated (``option``: what gave the DSN)."""
    try:
        conn = psycopg.connect(dsn, autocommit=autocommit, application_name=application_name,
                               **connect_timeout(dsn, connect_timeout_s))
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        raise translate_connect_error(exc, dsn, option=option) from None
    conn.adapters.register_loader("timestamptz", _TimestamptzOrInfinity)
    return conn


class _TimestamptzOrInfinity(TimestamptzLoader):
    """``infinity`` and ``-infinity`` as that text: Python's datetime has neither, and a row
    with such a created_at (the schema allows it) made `dead-letters list` and `show` fail
    with a traceback, hiding every dead letter (an audit with hostile rows)."""

    def load(self, data: Buffer) -> Any:
        if data in (b"infinity", b"-infinity"):
            return bytes(data).decode()
        return super().load(data)


def require_schema(check: dict[str, Any], table: str) -> None:
    """Raise what ``schema_check`` found wrong, said so a person can act: the relay's own
    tables there but not the outbox names a ``--table`` that is not there, or one that is
    not an outbox (migrating would help neither)."""
    if not (check["has_shards"] and check["has_settings"]):
        raise SchemaMissing()
    if not check["has_outbox"]:
        raise SchemaMissing(f"no table or view {table!r} (--table / OUTBOX_RELAY_TABLE): name the "
                            "outbox table, or the view `migrate --debezium-table` made")
    if check["missing_columns"]:
        raise ConfigError(f"{table!r} (--table / OUTBOX_RELAY_TABLE) is not an outbox: it has no "
                          f"column {', '.join(check['missing_columns'])}")


@contextmanager
def translated(*, schema_behind: bool = False) -> Iterator[None]:
    """Translate driver errors raised inside the block; with ``schema_behind`` (the relay's
    own statements, not a migration's), a missing column or function is a schema older
    than the relay."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing(
            f"the outbox schema is missing ({exc.diag.message_primary}): run `outbox-relay migrate`"
        ) from None
    except (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction) as exc:
        if not schema_behind:
            raise
        # A schema older than the relay (a migration not applied): a traceback and exit 1
        # before, after relay_started (an audit of the relay's operation).
        raise SchemaBehind(f"the schema is older than this relay ({exc.diag.message_primary}): "
                           "run `outbox-relay migrate`") from None
    except psycopg.errors.InsufficientPrivilege as exc:
        raise PermissionDenied(f"permission denied: {exc.diag.message_primary}") from None
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        # A standby, or a primary being failed over: wait for a writable one like for an
        # unreachable database.  The caller drops the connection, so the next attempt
        # reconnects (a multi-host DSN with target_session_attrs=read-write finds the new primary).
        raise DatabaseReadOnly(f"the database is read-only (standby or failover): "
                               f"{exc.diag.message_primary}") from None
    except psycopg.errors.QueryCanceled as exc:
        raise StatementCancelled(f"statement cancelled: {mask_text(str(exc).strip())}") from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise DatabaseUnavailable(f"database connection lost: {mask_text(str(exc).strip())}") from exc


def int_array(values: Iterable[int]) -> str:
    """Integers as a PostgreSQL array literal (``{1,2,3}``), for a parameter the query
    casts (``%(ids)s::bigint[]``).  psycopg dumps a Python list element by element, in
    Python, after a pass to pick the element type: for a mark of a few rows that was
    half the mark's client CPU (175 against 90 µs, measured).  A value, never SQL text:
    anything but integers fails the server's cast."""
    return "{" + ",".join(map(str, values)) + "}"


#: OutboxRow's (xid, id), and claim_batch's running byte count: C getters, as they run per row.
_XID_ID = itemgetter(OutboxRow._fields.index("xid"), OutboxRow._fields.index("id"))
_RUNNING_BYTES = itemgetter(len(OutboxRow._fields))
_ID, _SHARD = itemgetter(OutboxRow._fields.index("id")), itemgetter(OutboxRow._fields.index("shard"))


MAX_ROW_ID = (1 << 63) - 1  # bigint's largest
#: Rows in back-off a rewind reads for the next retry time (the retrying index's first).
NEXT_RETRY_LOOK = 10_000


def claim_params(*, shards: Sequence[ShardId], nshards: int, after: Cursor, limit: int,
                 max_bytes: int, budget_bytes: int, now: datetime | None,
                 sent_retries: Iterable[int] = ()) -> dict[str, Any]:
    """claim_batch's parameters for the claim of ``after``'s window.

    The range of commits after the previous window starts at its xmax: when the position
    is below it (a new window), the range's lower bound is "just below prev_xmax", not the
    position.  A row comparison from (0, 0) next to ``xid >= prev_xmax`` had the index scan
    start at the index's first entry and walk every entry below the window at each claim:
    the rows in back-off or held by a stall, and the dead entries of rows marked since the
    last vacuum (300,000 rows in back-off: 1,153 pages and 8 ms a claim, against 4 pages)."""
    if after.xid < after.prev_xmax:
        from_xid, from_id = after.prev_xmax - 1, MAX_ROW_ID  # every id of xid >= prev_xmax
    else:
        from_xid, from_id = after.xid, after.id
    return {
        "cur": after.cur,
        "prev_xmax": str(after.prev_xmax),
        # Only the transactions in flight then that can still have rows after the position:
        # on PostgreSQL 15 an xid = ANY(...) whose every xid is below the row comparison
        # read the pending index from that xid to its end (116 pages beside 30,000 rows in
        # back-off), where an empty array reads nothing.
        "prev_xip": int_array(x for x in after.prev_xip if x >= after.xid),
        "nshards": nshards,
        "shards": int_array(shards),
        "all_shards": len(shards) == nshards,
        "after_xid": str(after.xid),
        "after_id": after.id,
        "from_xid": str(from_xid),
        "from_id": from_id,
        "limit": limit,
        "max_bytes": max_bytes,
        "budget_bytes": budget_bytes,
        "now": now,
        "sent_retries": int_array(sent_retries),
    }


def check_not_transaction_pooled(dsn: str, *, application_name: str = "outbox-relay-probe") -> None:
    """Raise :class:`TransactionPoolerUnsupported` when ``dsn`` reaches PostgreSQL through a
    transaction pooler (:func:`outbox_core.pooling.transaction_pooled`).

    The relay keeps session state on purpose: LISTEN, the session advisory lock of the
    wake-up protocol (sql/migrations/0003_notify.sql) and ``synchronous_commit = off``
    for its own writes.  Behind a transaction pooler those would land on whatever
    server process a transaction borrowed: notifications lost, the wake-up lock
    stranded (every writer then pays for NOTIFY), and the application's sessions
    committing without waiting for the WAL.  So the relay refuses to run there.
    """
    with translated():
        pooled = transaction_pooled(lambda: connect(dsn, application_name=application_name))
    if pooled:
        raise TransactionPoolerUnsupported()


class Store:
    """One autocommit connection for claims, marks and leases.

    Owned by the pump's thread; not thread-safe.  ``now`` overrides the database
    clock in lease and retry arithmetic (tests); None means ``now()`` in SQL.
    """

    def __init__(self, dsn: str, *, now: datetime | None = None,
                 application_name: str = "outbox-relay",
                 on_statement: Callable[[], None] = lambda: None,
                 table: str = "outbox", keep_published: bool = True) -> None:
        """``keep_published`` False: a mark deletes the acknowledged rows instead of
        setting their ``published_at``."""
        self._dsn = dsn
        self.table = table
        self._mark_query = "mark_published" if keep_published else "delete_published"
        self._by_event = False  # mark_by_event_id
        # The two statements of every claim cycle, sent as prepared statements below the
        # cursor (relay/wire.py) while ``prepared_cycle``; else through the cursor, like
        # every other statement.
        self._claim_statement = Prepared("relay", "claim_batch", table=table)
        self._mark_statement = Prepared("relay", self._mark_query, table=table)
        self.prepared_cycle = INTERNALS
        self._on_statement = on_statement
        self._application_name = application_name[:63]
        self._conn: psycopg.Connection[Any] | None = None
        self.now = now
        self.queries = 0  # statements sent, for the idle-cost figures

    # -- connections -----------------------------------------------------------------------

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._dsn, application_name=self._application_name)
            # A mark lost to a database crash only means a redelivery, which consumers
            # absorb anyway; every relay write is fenced, so a lost lease write is safe
            # too.  Not waiting for the WAL flush roughly halves a batch's mark time.
            self._conn.execute(query("relay", "async_commit"))
        return self._conn

    def close(self) -> None:
        if self._conn is not None and not self._conn.closed:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None

    def ping(self) -> None:
        """Open the connection if it is not, and make one round trip (the mark lanes' probe
        of a connection before they give it work: relay/marker.py).  Raises the relay's
        database errors."""
        self._fetch("relay", "backend_pid", {})

    def reset(self) -> None:
        """Drop connections after an error; the next call reconnects."""
        self.close()

    def _fetch(self, group: str, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return self._execute(group, name, params, dict_row)

    def _fetch_tuples(self, group: str, name: str, *, params: dict[str, Any],
                      binary: bool = False) -> list[tuple[Any, ...]]:
        """Like _fetch, as plain tuples (the claim's hot path); ``binary``: results in
        PostgreSQL's binary format (a bytea payload comes as its bytes, not as hex)."""
        return self._execute(group, name, params, tuple_row, binary=binary)

    def _execute(self, group: str, name: str, params: dict[str, Any], row_factory: Any,
                 *, binary: bool = False) -> list[Any]:
        try:
            cur = self._counted().cursor(row_factory=row_factory)
            cur.execute(compose(group, name, table=self.table), params, binary=binary)
            # Not ``cur.description``: it builds a Column object per column each time.
            result = cur.pgresult
            return cur.fetchall() if result is not None and result.nfields else []
        except psycopg.Error as exc:
            self._failed(exc)

    def _run(self, statement: Prepared, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """A claim-cycle statement's rows as tuples (binary format), prepared when it can be."""
        if not self.prepared_cycle:
            return self._fetch_tuples(statement.group, statement.query, params=params, binary=True)
        try:
            return statement.run(self._counted(), params)
        except psycopg.Error as exc:
            self._failed(exc)

    def _counted(self) -> psycopg.Connection[Any]:
        """The connection, for one more statement."""
        conn = self.conn
        self.queries += 1
        self._on_statement()
        return conn

    def _failed(self, exc: psycopg.Error) -> NoReturn:
        """Raise ``exc`` translated (:func:`translated`); a connection that failed, or that
        reached a read-only server, is dropped first.  (No context manager around every
        statement: at a steady rate the claim cycle's two paid for theirs.)"""
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError,
                            psycopg.errors.ReadOnlySqlTransaction)):
            self.reset()
        with translated(schema_behind=True):
            raise exc

    # -- schema ---------------------------------------------------------------------------

    def check_schema(self) -> int:
        """Raise SchemaMissing unless migrated (ConfigError when ``table`` is not an outbox);
        return the configured shard count."""
        (row,) = self._fetch("relay", "schema_check", {"table": self.table})
        require_schema(row, self.table)
        settings = self._fetch("relay", "read_settings", {})
        if not settings:
            raise SchemaMissing("the relay settings row is missing: run `outbox-relay migrate`")
        return int(settings[0]["shards"])

    def outbox_identity(self) -> str:
        """Who writes exactly-once mode's position records: migration 0013's id of this
        database's outbox and the table's name.  ConfigError without that migration."""
        try:
            rows = self._fetch("relay", "read_outbox_id", {})
        except SchemaBehind:  # the connection is autocommit: still usable
            raise ConfigError("exactly-once mode needs migration 0013 (the outbox's identity in "
                              "its position records): run `outbox-relay migrate`") from None
        if not rows:
            raise SchemaMissing("the relay settings row is missing: run `outbox-relay migrate`")
        return f"{rows[0]['outbox_id']}/{self.table}"

    # -- outbox ---------------------------------------------------------------------------

    def claim(self, *, shards: Sequence[ShardId], nshards: int, after: Cursor, limit: int,
              max_bytes: int = 1_000_000, budget_bytes: int = 4 << 20,
              sent_retries: Iterable[int] = ()) -> Claimed:
        """Pending rows of ``after``'s window, in (xid, id) order after its position, up to
        ``limit`` rows and the row that crosses ``budget_bytes`` of payload; rows larger
        than ``max_bytes`` come without their payload (``value`` None, ``size`` set).
        ``sent_retries``: rows in back-off that the caller sent since its last full pass
        (their later rows no longer wait for them)."""
        found = self._run(self._claim_statement, claim_params(
            shards=shards, nshards=nshards, after=after, limit=limit, max_bytes=max_bytes,
            budget_bytes=budget_bytes, now=self.now, sent_retries=sent_retries))
        snapshot: str | None = None
        if after.cur is None and found and found[-1][0] is None:
            snapshot = found.pop()[5]
        # claim_batch's columns are OutboxRow's, then the running byte count.
        make = OutboxRow._make
        rows = [make(r[:11]) for r in found]
        # The query's two branches come out in (xid, id) order; keep that a guarantee
        # of this method, not of the executor (linear on sorted input).
        rows.sort(key=_XID_ID)
        cut = bool(found) and len(found) < limit and max(map(_RUNNING_BYTES, found)) >= budget_bytes
        return Claimed(rows, snapshot, cut)

    def sweep(self, *, shards: Sequence[ShardId], nshards: int) -> tuple[int, float | None]:
        """A rewind's look at the table, one statement: give rows whose xid is not this
        cluster's (restored, replicated from another cluster: above every xid assigned here)
        this transaction's, and find when the earliest row in back-off of ``shards`` is due.
        Returns (rows restamped, seconds until that retry or None: none ahead among the
        first NEXT_RETRY_LOOK rows in back-off, or no shards)."""
        rows = self._fetch("relay", "sweep", {
            "shards": int_array(shards), "nshards": nshards,
            "all_shards": bool(shards) and len(shards) == nshards,
            "limit": NEXT_RETRY_LOOK, "now": self.now})
        if not rows:
            return 0, None
        due = rows[0]["due_in_s"]
        return int(rows[0]["restamped"]), None if due is None else float(due)

    def mark_published(self, *, owner: str, leases: Sequence[Lease],
                       rows: Sequence[OutboxRow]) -> tuple[set[ShardId], set[RowId]]:
        """Mark acknowledged rows (or delete them, see ``keep_published``); returns (shards
        still held, ids marked)."""
        if not rows:
            return {lease.shard for lease in leases}, set()
        params = {
            "owner": owner,
            "held_shards": int_array(lease.shard for lease in leases),
            "held_tokens": int_array(lease.token for lease in leases),
            "ids": int_array(map(_ID, rows)),
            "row_shards": int_array(map(_SHARD, rows)),
            "now": self.now,
        }
        if self._by_event:
            params["event_ids"] = "{" + ",".join(row.event_id for row in rows) + "}"
        ((held, marked),) = self._run(self._mark_statement, params)
        return set(held), set(marked)  # ShardId and RowId are ints

    def mark_by_event_id(self) -> None:
        """Match the rows a mark, a failure or a dead letter names by id and event_id, not id
        alone: a partitioned outbox (see relay.sql's mark_published_by_event).  Idempotent."""
        if self._by_event:
            return
        self._by_event = True
        self._mark_query += "_by_event"
        self._mark_statement = Prepared("relay", self._mark_query, table=self.table)

    def _event_id(self, row: OutboxRow) -> str | None:
        return row.event_id if self._by_event else None  # None: by id (the plain outbox)

    def event_ids(self, ids: Sequence[RowId]) -> list[tuple[RowId, str]]:
        """The event_id of each row of ``ids`` still in the table."""
        if not ids:
            return []
        rows = self._fetch("relay", "event_ids", {"ids": list(ids)})
        return [(RowId(int(r["id"])), str(r["event_id"])) for r in rows]

    def record_failure(self, *, owner: str, lease: Lease, row: OutboxRow, error: str,
                       backoff_s: float) -> int | None:
        """Count a failed attempt (fenced); None when the lease was lost."""
        rows = self._fetch("relay", "record_failure", {
            "owner": owner, "shard": lease.shard, "token": lease.token, "id": row.id,
            "event_id": self._event_id(row), "error": error[:2000], "backoff_s": backoff_s, "now": self.now,
        })
        return int(rows[0]["attempts"]) if rows else None

    def dead_letter(self, *, owner: str, lease: Lease, row: OutboxRow, reason: str,
                    error: str) -> bool:
        """Move a row to the dead letters (fenced, one statement); False when fenced out."""
        rows = self._fetch("relay", "dead_letter", {
            "owner": owner, "shard": lease.shard, "token": lease.token, "id": row.id,
            "event_id": self._event_id(row), "reason": reason, "error": error[:2000],
        })
        return bool(rows)

    def cleanup_batch(self, *, retention_s: float, limit: int,
                      after: datetime | None = None) -> tuple[int, datetime | None]:
        """Delete one batch of published rows past retention, published at ``after`` or
        later; returns (rows deleted, the newest published_at among them)."""
        (row,) = self._fetch("admin", "cleanup_batch",
                             {"retention_s": retention_s, "limit": limit, "after": after})
        return int(row["deleted"]), row["last_published_at"]

    def maintain_partitions(self, *, retention_s: float | None) -> Any:
        """Create the coming days' partitions, drop past ones (partitioned outbox only)."""
        from relay.partitions import maintain

        with translated():
            try:
                self.queries += 1
                self._on_statement()
                return maintain(self.conn, retention_s=retention_s)
            except (psycopg.OperationalError, psycopg.InterfaceError,
                    psycopg.errors.ReadOnlySqlTransaction):
                self.reset()
                raise

    def is_partitioned(self) -> bool:
        from relay.partitions import is_partitioned

        with translated():
            return is_partitioned(self.conn)

    def backlog(self) -> tuple[int, float, int]:
        """(pending rows, age of the oldest pending row in seconds, rows in back-off)."""
        (row,) = self._fetch("relay", "backlog", {"now": self.now})
        return int(row["pending"]), float(row["oldest_age_s"]), int(row["retrying"])

    # -- leases ---------------------------------------------------------------------------

    def heartbeat(self, *, owner: str, ttl_s: float, leases: Sequence[Lease], lease_s: float,
                  stalled: str = "{}") -> tuple[int, dict[ShardId, Token]]:
        """One heartbeat in one statement: announce this replica (and, as JSON, the
        partitions it waits on) and renew ``leases`` by token.  Returns the number of live
        replicas (itself included) and the leases renewed, shard to token: a lease missing
        there was taken over by another replica."""
        (row,) = self._fetch("leases", "heartbeat", {
            "owner": owner, "ttl_s": ttl_s, "now": self.now, "stalled": stalled, "lease_s": lease_s,
            "shards": int_array(lease.shard for lease in leases),
            "tokens": int_array(lease.token for lease in leases),
        })
        renewed = {ShardId(shard): Token(token) for shard, token in zip(row["shards"], row["tokens"], strict=True)}
        return max(1, int(row["live"])), renewed

    def forget_replica(self, *, owner: str) -> None:
        self._fetch("leases", "forget_replica", {"owner": owner})

    def notify_shards(self, *, owner: str) -> None:
        self._fetch("leases", "notify_shards", {"owner": owner})

    def take_owner_lock(self, owner: str) -> bool:
        """The owner name's advisory lock (leases.sql): False while another live process
        runs under the same name."""
        (row,) = self._fetch("leases", "take_owner_lock", {"owner": owner})
        return bool(row["sole"])

    def claim_shards(self, *, owner: str, limit: int, lease_s: float,
                     held: Sequence[ShardId] | None = None) -> dict[ShardId, Token]:
        """Free or expired shards; with ``held`` (the shards this process holds), also the
        ones a previous process of the same owner name left leased (see leases.sql)."""
        if limit <= 0:
            return {}
        rows = self._fetch("leases", "claim_shards", {
            "owner": owner, "limit": limit, "lease_s": lease_s, "now": self.now,
            "reclaim": held is not None, "held": int_array(held or ()),
        })
        return {ShardId(r["shard"]): Token(r["token"]) for r in rows}

    def release(self, *, owner: str, leases: Sequence[Lease]) -> set[ShardId]:
        if not leases:
            return set()
        rows = self._fetch("leases", "release_shards", {
            "owner": owner, "shards": int_array(lease.shard for lease in leases),
            "tokens": int_array(lease.token for lease in leases),
        })
        return {ShardId(r["shard"]) for r in rows}

    def shard_table(self) -> list[dict[str, Any]]:
        return self._fetch("leases", "shard_table", {"now": self.now})
