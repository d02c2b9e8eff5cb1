"""The short-lived commands: migrate, status, cleanup, dead-letters."""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outbox_core.text import uuid_from_text
from relay import db, migrate, migrate_index, partitions, store
from relay.config import Settings
from relay.errors import ConfigError, NotFound, PermissionDenied
from relay.queries import compose


def dispatch(command: str, args: argparse.Namespace, settings: Settings) -> int:
    from relay import logs

    log = logs.get()
    if command == "migrate":
        # Checked before anything is applied: a bad --debezium-table or --topic-template was
        # refused only after the migrations had changed the database (an audit's finding).
        adoption = _adoption(args) if args.debezium_table else None
        applied = migrate.apply(settings.dsn, shards=settings.shards, partitioned=args.partitioned,
                                log=log, lock_timeout_s=settings.lock_timeout_s,
                                index_wait_s=settings.index_wait_s)
        level = migrate.migrations()[-1].version  # every one of them is recorded now
        print(f"migrations applied: {', '.join(applied) if applied else f'none (schema up to date: level {level})'}")
        if adoption is not None:
            return _adopt(settings, args, *adoption)
        return 0
    if command == "status":
        return status(settings, as_json=args.json)
    if command == "cleanup":
        if settings.cleanup_retention_s is None:
            raise ConfigError("cleanup needs --cleanup-retention-s (or OUTBOX_RELAY_CLEANUP_RETENTION_S)")
        return cleanup(settings, retention_s=settings.cleanup_retention_s, batch=settings.cleanup_batch)
    if command == "dead-letters":
        return dead_letters(settings, args)
    if command == "replay":
        from relay import replay_admin

        return replay_admin.command(settings, args)
    if command == "console":
        from relay.console import main as console_main

        return console_main(settings)
    raise ConfigError(f"unknown command {command!r}")


def _adoption(args: argparse.Namespace) -> tuple[str, str, str]:
    """migrate --debezium-table's options checked (no I/O): (source, view, topic template)."""
    from relay.adopt import DEFAULT_TOPIC_TEMPLATE, topic_expression
    from relay.options import _table_name

    try:
        source = _table_name(args.debezium_table)
        view = _table_name(args.view or f"{source}_relay")
    except ValueError as exc:
        raise ConfigError(f"--debezium-table/--view: {exc}") from None
    template = DEFAULT_TOPIC_TEMPLATE if args.topic_template is None else args.topic_template
    topic_expression(template)  # ConfigError when it is not one
    return source, view, template


def _adopt(settings: Settings, args: argparse.Namespace, source: str, view: str, template: str) -> int:
    from relay import logs
    from relay.adopt import adopt

    conn = db.connect(settings.dsn, application_name="outbox-relay-migrate", autocommit=True, prepare=False)
    try:
        with db.translated():
            report = adopt(conn, source=source, view=view, topic_template=template,
                           ce_source=args.cloudevents_source, existing=args.existing or "published",
                           dsn=settings.dsn, lock_timeout_s=settings.lock_timeout_s, tries=migrate.LOCK_TRIES,
                           index_wait_s=settings.index_wait_s, log=logs.get())
    except psycopg.errors.ProgrammingError as exc:  # SQLSTATE class 42
        # A table without Debezium's columns (aggregatetype ...), a --view naming a table or
        # a schema that is not there were tracebacks (each in adopt's first transaction,
        # rolled back).
        raise ConfigError(f"--debezium-table {source} / --view {view}: {exc.diag.message_primary} "
                          "(a Debezium outbox has the columns id, aggregatetype, aggregateid, type "
                          "and payload)") from None
    finally:
        conn.close()
    print(f"locked {source} in ACCESS EXCLUSIVE mode for {report.lock_s * 1000:.0f} ms "
          "(columns with stored defaults, view, trigger: catalog only, no table rewrite)")
    print(f"numbered {report.numbered} existing rows in {report.numbering_s:.2f} s "
          "(batches in their own transactions, row locks only)")
    print(f"built the indexes CONCURRENTLY in {report.index_s:.2f} s "
          "(SHARE UPDATE EXCLUSIVE: writers went on)")
    if report.already_adopted:
        print(f"{source} was adopted before: its rows keep their state (--existing applies "
              "to the first adoption only)")
    elif report.existing == "published":
        print("existing rows: marked published (--existing published, the default: Debezium "
              "delivered them); only rows written from now on are relayed")
    else:
        print("existing rows: pending (--existing pending): relayed before every newer row of "
              "their key, in physical order; start the relay now")
    print(f"adopted {source}: run the relay with --table {view}")
    return 0


def _rows(conn: Any, group: str, name: str, params: dict[str, Any],
          table: str = "outbox") -> list[dict[str, Any]]:
    with db.translated(schema_behind=True):
        cur = conn.cursor(row_factory=dict_row)
        cur.execute(compose(group, name, table=table), params)
        return cur.fetchall() if cur.description else []


def _iso(value: datetime | str | None) -> str | None:
    """ISO 8601, or ``infinity`` / ``-infinity`` as PostgreSQL writes them (db.connect)."""
    return value if value is None or isinstance(value, str) else value.isoformat()


def _finite(seconds: Any) -> float | None:
    """An age in seconds, or None for an infinite one (a created_at of ±infinity): JSON has no
    Infinity, and `status --json` printed it, which strict parsers refuse."""
    value = float(seconds)
    return round(value, 3) if math.isfinite(value) else None


def status(settings: Settings, *, as_json: bool) -> int:
    conn = db.connect(settings.dsn, application_name="outbox-relay-status", prepare=False)
    try:
        (schema,) = _rows(conn, "relay", "schema_check", {"table": settings.table})
        db.require_schema(schema, settings.table)
        (backlog,) = _rows(conn, "admin", "status_backlog", {}, settings.table)
        (dead,) = _rows(conn, "admin", "status_dead_letters", {})
        shards = _rows(conn, "leases", "shard_table", {"now": None})
        stalled = _rows(conn, "admin", "status_stalled", {})
        detached = _detached(conn) if settings.table == "outbox" else []
        claim_index = _claim_index(conn, settings.table)
    finally:
        conn.close()
    from relay.replay_admin import format_replays, status_section

    replays = status_section(settings)
    report: dict[str, Any] = {
        "pending": int(backlog["pending"]),
        "oldest_pending_age_s": _finite(backlog["oldest_pending_age_s"]),
        "retrying": int(backlog["retrying"]),
        "dead_letters": int(dead["dead_letters"]),
        "shards": [
            {"shard": r["shard"], "owner": r["owner"], "lease_until": _iso(r["lease_until"]),
             "token": r["token"], "live": bool(r["live"])}
            for r in shards
        ],
        "replays": replays,
        # Unpublished rows of tables detached from a partitioned outbox: not in "pending",
        # never published (pending None: not counted, the table locked or not readable).
        "detached_pending": detached,
        "stalled_partitions": [
            {"topic": r["topic"], "partition": r["partition"], "rows_waiting": int(r["rows_waiting"]),
             "replica": r["owner"]} for r in stalled
        ],
        # The claim's index migrate keeps for this server and shard count, and the claim's
        # indexes there are; for a view migrate --debezium-table made, the adopted table's
        # (None: another --table).
        "claim_index": claim_index,
    }
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"pending rows:        {report['pending']}")
    age = report["oldest_pending_age_s"]
    print("oldest pending age:  " + (f"{age:.1f} s" if age is not None else "unknown (a created_at is infinite)"))
    print(f"retrying rows:       {report['retrying']}")
    print(f"dead letters:        {report['dead_letters']}")
    for d in report["detached_pending"]:
        print(f"detached rows:       {_detached_count(d)} in {d['table']} (detached from the outbox: "
              "never published; attach it again or copy them into the outbox)")
    if claim_index is not None:
        print(f"claim index:         {migrate_index.describe(claim_index)}")
    print()
    print(f"{'shard':>5}  {'owner':<32}  {'lease until':<32}  {'token':>6}  state")
    for r in report["shards"]:
        state = "live" if r["live"] else ("expired" if r["owner"] else "free")
        print(f"{r['shard']:>5}  {(r['owner'] or '-'):<32}  {(r['lease_until'] or '-'):<32}  "
              f"{r['token']:>6}  {state}")
    if report["stalled_partitions"]:
        print()
        print("waiting on partitions that acknowledge nothing (no leader?):")
        for r in report["stalled_partitions"]:
            print(f"  {r['topic']} [{r['partition']}]: {r['rows_waiting']} rows waiting "
                  f"(replica {r['replica']}); later rows of their keys wait too")
    if replays:
        print()
        for line in format_replays(replays):
            print(line)
    return 0


def _detached(conn: Any) -> list[dict[str, Any]]:
    """The tables detached from a partitioned outbox that hold unpublished rows (or whose
    rows were not counted), as `status` shows them (relay/partitions.py)."""
    with db.translated():
        if not partitions.is_partitioned(conn):
            return []
        counts, unreadable = partitions.detached(conn, bounded=False)  # no transaction block
    return [{"table": name, "pending": n, "readable": name not in unreadable}
            for name, n in counts.items() if n != 0]


def _claim_index(conn: Any, table: str) -> dict[str, Any] | None:
    with db.translated(schema_behind=True):
        return migrate_index.table_state(conn, table)


def _detached_count(d: dict[str, Any]) -> str:
    if not d["readable"]:
        return "unknown unpublished rows (no SELECT privilege on it)"
    if d["pending"] is None:
        return "unknown unpublished rows (locked)"
    capped = "at least " if d["pending"] >= partitions.DETACHED_COUNT_CAP else ""
    return f"{capped}{d['pending']} unpublished rows"


def cleanup(settings: Settings, *, retention_s: float, batch: int) -> int:
    from relay.janitor import Janitor

    st = store.Store(settings.dsn, table=settings.table, one_shot=True)
    try:
        st.check_schema()  # --table naming another table: its rows must not be deleted
        if st.is_partitioned():
            report = st.maintain_partitions(retention_s=retention_s)
            print(f"partitions created: {', '.join(report.created) or 'none'}; "
                  f"dropped: {', '.join(report.dropped) or 'none'}; "
                  f"kept (rows pending): {', '.join(report.kept_pending) or 'none'}; "
                  f"rows in outbox_default: {report.default_rows}")
            for table, pending in report.detached_pending.items():
                count = "an unknown number of" if pending is None else str(pending)
                print(f"warning: {table} is detached from the outbox and holds {count} unpublished "
                      "rows, which will never be published: attach it again or copy them into the outbox",
                      file=sys.stderr)
            for table in report.unreadable:
                print(f"warning: {table} is detached from the outbox and this role has no SELECT privilege "
                      "on it: its unpublished rows, if any, are not counted (and never published); grant "
                      "SELECT on it to this role, or look as its owner", file=sys.stderr)
            # Then the strays, row by row, as run's cleanup does (outbox_default's rows, the
            # published rows of days kept for their pending ones): the command stopped at the
            # partitions, and those rows stayed for ever (an audit of the relay's operation).
        janitor = Janitor(st, retention_s=retention_s, batch=batch, interval_s=0,
                          max_batches=1_000_000)
        deleted = janitor.run_once()
    finally:
        st.close()
    print(f"deleted {deleted} published rows older than {retention_s:g} s")
    return 0


def _check_dead_letter_args(args: argparse.Namespace) -> None:
    """Before connecting (`purge ID --all` purged every dead letter, the ID ignored): the
    EVENT_IDs each action takes, and each a UUID."""
    if args.action == "list":
        return
    if args.action == "show" and len(args.event_ids) != 1:
        raise ConfigError("dead-letters show takes exactly one EVENT_ID")
    every = getattr(args, "all", False)
    if args.event_ids and every:
        raise ConfigError(f"dead-letters {args.action}: give EVENT_IDs or --all, not both")
    if args.action != "show" and not args.event_ids and not every:
        raise ConfigError(f"dead-letters {args.action} needs EVENT_ID arguments or --all")
    canonical = []
    for event_id in args.event_ids:
        parsed = uuid_from_text(event_id)
        if parsed is None:
            raise ConfigError(f"dead-letters {args.action}: {event_id!r} is not an event_id (a UUID)")
        canonical.append(str(parsed))
    # The ids as PostgreSQL prints them: the rows moved are told from the ones not found by
    # that text (an id given in capitals or braces was requeued, then said not found).
    args.event_ids = canonical


def dead_letters(settings: Settings, args: argparse.Namespace) -> int:
    _check_dead_letter_args(args)
    conn = db.connect(settings.dsn, application_name="outbox-relay-dead-letters", prepare=False)
    try:
        # As status and cleanup do: a --table that is not there said "the outbox schema is
        # missing: run migrate" on requeue (which would not help) and listed on regardless.
        (schema,) = _rows(conn, "relay", "schema_check", {"table": settings.table})
        db.require_schema(schema, settings.table)
        action = args.action
        if action == "list":
            items = list_dead_letters(conn, limit=args.limit)
            if args.json:
                json.dump(items, sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                for r in items:
                    print(f"{r['event_id']}  {r['topic']:<24} {r['reason']:<20} attempts={r['attempts']}  {r['error'][:80]}")
                print(f"{len(items)} dead letter(s)")
            return 0
        if action == "show":
            shown = show_dead_letter(conn, args.event_ids[0])
            if shown is None:
                raise NotFound(f"no dead letter with event_id {args.event_ids[0]}")
            json.dump(shown, sys.stdout, indent=2)
            sys.stdout.write("\n")
            return 0
        try:
            rows = move_dead_letters(conn, action, event_ids=args.event_ids, every=bool(args.all),
                                     table=settings.table)
        except PermissionDenied as exc:  # the relay's own role may not, by design
            raise PermissionDenied(
                f"{exc}: dead-letters {action} writes the outbox and outbox_dead_letters, which the "
                "relay's role (outbox_relay) may not: run it with a DSN of the tables' owner or of "
                "an operator role (outbox_core/sql/roles/outbox_relay_role.sql shows one)") from None
        verb = "requeued" if action == "requeue" else "purged"
        print(f"{verb} {len(rows)} dead letter(s)")
        missing = sorted(set(args.event_ids) - {str(r["event_id"]) for r in rows})
        if missing and not args.all:  # a mistyped id said "requeued 0" and exit 0
            raise NotFound(f"no dead letter with event_id {', '.join(missing)}")
        return 0
    finally:
        conn.close()


# -- dead letters as functions (the CLI above and the console, relay/console.py) ------------


#: A listed dead letter's key is cut to this many characters (``key_bytes`` gives its size):
#: a row dead-lettered for its size may carry a key of many megabytes.
LIST_KEY_CHARS = 200


def list_dead_letters(conn: Any, *, limit: int) -> list[dict[str, Any]]:
    """The oldest dead letters first, without payloads, keys cut to ``LIST_KEY_CHARS``."""
    rows = _rows(conn, "admin", "dead_letters_list", {"limit": limit, "key_chars": LIST_KEY_CHARS})
    return [{**r, "created_at": _iso(r["created_at"]), "dead_at": _iso(r["dead_at"])} for r in rows]


def show_dead_letter(conn: Any, event_id: str, *, max_chars: int | None = None
                     ) -> dict[str, Any] | None:
    """One dead letter with its payload and headers (each cut to ``max_chars`` characters
    when given, their sizes in ``key_bytes``, ``payload_size``, ``header_bytes``), or None."""
    rows = _rows(conn, "admin", "dead_letter_show", {"event_id": event_id, "max_chars": max_chars})
    if not rows:
        return None
    r = rows[0]
    return {**r, "created_at": _iso(r["created_at"]), "dead_at": _iso(r["dead_at"])}


def move_dead_letters(conn: Any, action: str, *, event_ids: list[str], every: bool,
                      table: str = "outbox") -> list[dict[str, Any]]:
    """``requeue`` (back into the outbox, same event_id) or ``purge``; returns the rows moved."""
    name = "dead_letter_requeue" if action == "requeue" else "dead_letter_purge"
    with conn.transaction():
        try:
            return _rows(conn, "admin", name, {"all": every, "event_ids": event_ids}, table)
        except psycopg.errors.FeatureNotSupported as exc:
            raise ConfigError(f"cannot requeue into {table}: "
                              f"{exc.diag.message_primary}; requeue into the source table by hand "
                              "(dead-letters show prints the row)") from None
