"""The replay commands: ``replay --since ...`` (request or ``--dry-run``), ``replay list``,
``replay cancel ID``, and the replays section of ``status``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from relay.config import Settings
from relay.errors import ConfigError, NotFound, PermissionDenied
from relay.replay_store import MAX_REPLAY_RATE, MIN_REPLAY_RATE, ReplayStore

#: Events per second of one replay over all replicas, unless --rate says otherwise.
DEFAULT_REPLAY_RATE = 1000.0
#: --since/--until's bounds: 0001-01-01 in a time zone west of UTC was stored as a year
#: before 1, which psycopg cannot read back, and every relay died reading the replays.
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)

_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str, *, now: datetime | None = None) -> datetime:
    """ISO 8601 (UTC when no offset is given) or a duration ago: ``90s``, ``15m``, ``2h``,
    ``7d``; in UTC, between :data:`EARLIEST` and :data:`LATEST`."""
    now = now or datetime.now(UTC)
    match = _AGO.match(text.strip())
    try:
        if match:
            value = now - timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
        else:
            value = datetime.fromisoformat(text.strip())
            value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:  # before year 1 or after 9999 in UTC
        value = None
    except ValueError:
        raise ConfigError(f"not a time: {text!r} (ISO 8601 such as 2026-01-31T12:00:00Z, "
                          "or a duration ago such as 2h)") from None
    if value is None or not EARLIEST <= value <= LATEST:
        raise ConfigError(f"{text!r} is outside {EARLIEST:%Y-%m-%d} .. {LATEST:%Y-%m-%d} UTC "
                          f"(to replay every row retained, give --since {EARLIEST:%Y-%m-%d})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("list", "cancel"),
                        help="list replays, or cancel one (default: request a replay)")
    parser.add_argument("replay_id", nargs="?", type=int, metavar="ID")
    parser.add_argument("--since", metavar="TIME", help="first created_at replayed (ISO 8601 or 2h)")
    parser.add_argument("--until", metavar="TIME", help="created_at up to (excluded; default: now)")
    parser.add_argument("--topic", action="append", default=[], metavar="T", help="only this topic, repeatable")
    parser.add_argument("--key", action="append", default=[], metavar="K", help="only this key, repeatable")
    parser.add_argument("--rate", type=float, default=None, metavar="N",
                        help=f"events per second over all replicas (default: {DEFAULT_REPLAY_RATE:g})")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the rows per topic and the range retained; record nothing")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: _iso(v) for k, v in row.items()}


def check_arguments(args: argparse.Namespace) -> tuple[datetime, datetime | None, float] | None:
    """Refuse, before connecting, what the action does not take: ``replay list 5`` listed every
    replay and ``replay cancel 5 --since 2h`` cancelled replay 5, each dropping the rest in
    silence.  A request's values are checked here too and returned (:func:`_request_values`);
    None for list and cancel."""
    chosen = [flag for flag, given in (
        ("--since", args.since is not None), ("--until", args.until is not None),
        ("--topic", bool(args.topic)), ("--key", bool(args.key)), ("--rate", args.rate is not None),
        ("--dry-run", args.dry_run)) if given]
    if args.action is None:
        return _request_values(args)
    if args.action == "list" and args.replay_id is not None:
        raise ConfigError(f"replay list takes no ID (got {args.replay_id}); it lists the latest "
                          "replays, and `replay cancel ID` cancels one")
    if args.action == "cancel" and args.replay_id is None:
        raise ConfigError("replay cancel takes the replay's ID")
    if chosen:
        raise ConfigError(f"replay {args.action} takes no {', '.join(chosen)}: "
                          f"{'that chooses' if len(chosen) == 1 else 'those choose'} what a new replay sends "
                          "(`replay --since TIME ...`)")
    return None


def _request_values(args: argparse.Namespace) -> tuple[datetime, datetime | None, float]:
    """A replay request's range and rate, checked: (since, until or None, rate)."""
    if not args.since:
        raise ConfigError("replay needs --since TIME (or: replay list | replay cancel ID)")
    rate = DEFAULT_REPLAY_RATE if args.rate is None else args.rate
    if not MIN_REPLAY_RATE <= rate <= MAX_REPLAY_RATE:  # NaN fails too
        # inf was stored and killed every relay that ran the replay (int(inf) tokens).
        raise ConfigError(f"--rate must be {MIN_REPLAY_RATE:g} to {MAX_REPLAY_RATE:,.0f} events "
                          f"per second, got {rate:g}")
    since = parse_time(args.since)
    until = parse_time(args.until) if args.until else None
    if until is not None and until <= since:
        raise ConfigError("--until must be after --since")
    if until is None and since >= datetime.now(UTC):  # the range would be empty
        raise ConfigError(f"--since {args.since!r} is in the future: nothing was created after it yet")
    return since, until, rate


def command(settings: Settings, args: argparse.Namespace) -> int:
    request = check_arguments(args)
    store = ReplayStore(settings.dsn, application_name="outbox-relay-replay", table=settings.table, one_shot=True)
    try:
        store.check_schema()
        if args.action == "list":
            rows = [_plain(r) for r in store.list_replays(limit=100)]
            if args.json:
                _dump(rows)
            else:
                for line in format_replays(rows):
                    print(line)
            return 0
        if args.action == "cancel":
            if not store.cancel(args.replay_id):
                raise NotFound(f"no active replay {args.replay_id}")
            if args.json:
                _dump({"cancelled": args.replay_id})
            else:
                print(f"cancelled replay {args.replay_id}")
            return 0
        assert request is not None  # neither list nor cancel
        return _request(store, args, *request)
    finally:
        store.close()


def _request(store: ReplayStore, args: argparse.Namespace, since: datetime, until: datetime | None,
             rate: float) -> int:
    if args.dry_run:
        per_topic, retained = store.dry_run(since=since, until=until, topics=args.topic, keys=args.key)
        report = {"topics": [_plain(r) for r in per_topic], "retained": _plain(retained),
                  "rows": sum(int(r["rows"]) for r in per_topic)}
        if args.json:
            _dump(report)
            return 0
        print(f"retained published rows: {retained['rows']}, created "
              f"{_iso(retained['oldest']) or '-'} .. {_iso(retained['newest']) or '-'}")
        if retained["oldest"] is not None and retained["oldest"] > since:
            print(f"note: --since is before the oldest retained row ({_iso(retained['oldest'])}): "
                  "rows created before it, if there were any, are no longer retained")
        for r in per_topic:
            print(f"{r['topic']:<32} {r['rows']:>10} rows  {_iso(r['first_created_at'])} .. "
                  f"{_iso(r['last_created_at'])}")
        print(f"{report['rows']} row(s) would be replayed (dry run: nothing recorded)")
        return 0
    try:
        row = store.create(since=since, until=until, topics=args.topic, keys=args.key, rate=rate,
                           requested_by=None)
    except PermissionDenied as exc:  # the relay's own role may not, by design
        # It said only "permission denied for table outbox_relay_replays" (an audit of the
        # relay's operation), where dead-letters requeue says whose DSN to use.
        raise PermissionDenied(
            f"{exc}: a replay request writes outbox_relay_replays, which the relay's role "
            "(outbox_relay) may not: run it with a DSN of the tables' owner or of an operator "
            "role (outbox_core/sql/roles/outbox_relay_role.sql shows one)") from None
    if args.json:
        _dump(_plain(row))
    else:
        print(f"replay {row['id']} requested: {row['selected_rows']} row(s) created "
              f"{_iso(row['since'])} .. {_iso(row['until'])}, at most {rate:g} events/s")
    return 0


def format_replays(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'id':>5}  {'state':<9}  {'selected':>9}  {'sent':>9}  {'left':>9}  {'shards done':>11}  range"]
    for r in rows:
        lines.append(f"{r['id']:>5}  {r['state']:<9}  {r['selected_rows']:>9}  {r['sent']:>9}  "
                     f"{r['rows_left']:>9}  {r['shards_done']:>11}  {r['since']} .. {r['until']}")
    return lines


def status_section(settings: Settings) -> list[dict[str, Any]]:
    """The active and recent replays, for ``status``."""
    store = ReplayStore(settings.dsn, application_name="outbox-relay-status", table=settings.table, one_shot=True)
    try:
        return [_plain(r) for r in store.list_replays(limit=10)]
    finally:
        store.close()


def _dump(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
