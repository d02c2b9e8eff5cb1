"""The PostgreSQL side: claim, mark, leases (LISTEN and the wake-up lock: relay/wakeup.py).

Only this module (with relay/db.py, which opens its connections and translates the
driver's errors, relay/wire.py, which sends its claim and mark as prepared statements,
and the migration runner) talks to psycopg.  The lease statements are
relay/store_leases.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from operator import itemgetter
from typing import Any, NoReturn

import psycopg
import psycopg.errors
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.rows import dict_row, tuple_row

from relay import migrate_index

# Connections and error translation live in relay/db.py; the names other modules and the
# tests import from here are re-exported.
from relay.db import check_not_transaction_pooled as check_not_transaction_pooled
from relay.db import connect as connect
from relay.db import int_array, require_schema
from relay.db import translate_connect_error as translate_connect_error
from relay.db import translated as translated
from relay.errors import ConfigError, SchemaBehind, SchemaMissing
from relay.marker import MarkLosses
from relay.model import Claimed, Cursor, Lease, OutboxRow, RowId, ShardId
from relay.queries import compose, query
from relay.store_leases import LeaseStatements
from relay.wire import INTERNALS, Prepared

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



class Store(LeaseStatements):
    """One autocommit connection for claims, marks and leases.

    Owned by the pump's thread; not thread-safe.  ``now`` overrides the database
    clock in lease and retry arithmetic (tests); None means ``now()`` in SQL.
    """

    def __init__(self, dsn: str, *, now: datetime | None = None,
                 application_name: str = "outbox-relay",
                 on_statement: Callable[[], None] = lambda: None,
                 table: str = "outbox", keep_published: bool = True, one_shot: bool = False) -> None:
        """``keep_published`` False: a mark deletes the acknowledged rows instead of
        setting their ``published_at``.  ``one_shot``: a one-shot command's store (cleanup,
        replay, status, the console), which must work through a transaction pooler: its
        connection sets nothing for the session and prepares no statement (see :attr:`conn`)."""
        self._dsn = dsn
        self._one_shot = one_shot
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
        #: Mark statements committed (relay/app_deps.py: a mark connection found broken with
        #: none committed since the database's outage broke in that outage).
        self.marks = 0
        #: A mark connection's losses in a row and its re-open's back-off (relay/marker.py).
        self.losses = MarkLosses()

    # -- connections -----------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The connection's application_name (``outbox-relay:<owner><role>``, as the server
        shows it in pg_stat_activity): how the relay's log lines name it."""
        return self._application_name

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._dsn, application_name=self._application_name, prepare=not self._one_shot)
            if not self._one_shot:
                # A mark lost to a database crash only means a redelivery, which consumers
                # absorb anyway; every relay write is fenced, so a lost lease write is safe
                # too.  Not waiting for the WAL flush roughly halves a batch's mark time.
                # Never on a one-shot command's connection: through a transaction pooler the
                # setting stayed on the server connection, and the application's transactions
                # there committed without waiting for the flush either (a crash could lose
                # them, outbox rows included).
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
        reached a read-only server, is dropped first.  A statement the server cancelled
        (57014: a ``statement_timeout``, a lock held longer than it) leaves its connection
        as it was, idle and answering: kept (psycopg counts the cancel an OperationalError,
        and each cancel cost a new connection, its session gone from pg_stat_activity while
        a lock lasted).  (No context manager around every statement: at a steady rate the
        claim cycle's two paid for theirs.)"""
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError,
                            psycopg.errors.ReadOnlySqlTransaction)) and not self._answered(exc):
            self.reset()
        with translated(schema_behind=True):
            raise exc

    def _answered(self, exc: psycopg.Error) -> bool:
        """``exc`` is a cancel the server answered on a connection still usable: not broken,
        outside a transaction (an autocommit statement's) and not in a pipeline."""
        conn = self._conn
        return (isinstance(exc, psycopg.errors.QueryCanceled) and conn is not None and not conn.closed
                and not conn.broken and conn.info.transaction_status == TransactionStatus.IDLE
                and conn.info.pipeline_status == PipelineStatus.OFF)

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

    def claim_index_problem(self) -> str:
        """'' when the claim's index is the one migrate keeps for the server and the shard
        count (for a view migrate --debezium-table made: the adopted table's, valid); else
        what is there and what to do (relay/migrate_index.py, state)."""
        with translated(schema_behind=True):
            found = migrate_index.table_state(self._counted(), self.table)
        return "" if found is None or found["ok"] else migrate_index.describe(found)

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
        self.marks += 1
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
