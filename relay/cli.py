"""``outbox-relay``: run | migrate | status | cleanup | dead-letters | replay | console | demo | bench.

Expected failures (bad options, a wrong DSN, a missing schema, rejected
credentials) end with one line on stderr saying what to fix and a non-zero exit
code, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from relay import __version__
from relay.config import (
    ENV_PREFIX,
    OPTIONS,
    _flag,
    build_settings,
    env_values,
    kafka_env_properties,
    parse_kafka_property,
)
from relay.errors import ConfigError, RelayError

PROG = "outbox-relay"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_options(parser: argparse.ArgumentParser, command: str) -> None:
    for option in OPTIONS:
        if command not in option.commands:
            continue
        default = "" if option.default is None else f" (default: {option.default})"
        secret = f"; or {option.env}_FILE naming a file" if option.secret else ""
        if option.parse is _flag:  # a bare --exactly-once means true; a value still works
            parser.add_argument(option.flag, dest=option.name, default=None, metavar="BOOL",
                                nargs="?", const="true",
                                help=f"{option.help}{default} [env: {option.env}{secret}]")
            continue
        parser.add_argument(option.flag, dest=option.name, default=None, metavar="VALUE",
                            help=f"{option.help}{default} [env: {option.env}{secret}]")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Transactional outbox relay: PostgreSQL outbox -> Kafka.",
                     epilog=f"Every option also reads {ENV_PREFIX}<NAME>; librdkafka properties pass "
                            f"through as {ENV_PREFIX}KAFKA_<PROPERTY> (e.g. {ENV_PREFIX}KAFKA_SECURITY_PROTOCOL).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    run = sub.add_parser("run", help="relay outbox rows to Kafka until SIGTERM")
    _add_options(run, "run")
    run.add_argument("--kafka-property", action="append", default=[], metavar="NAME=VALUE",
                     help=f"a librdkafka property, repeatable [env: {ENV_PREFIX}KAFKA_<PROPERTY>]")

    migrate = sub.add_parser("migrate", help="create or update the schema")
    _add_options(migrate, "migrate")
    migrate.add_argument("--print", action="store_true", dest="print_sql",
                         help="print the SQL instead of applying it (for your own migration tool)")
    migrate.add_argument("--partitioned", action="store_true",
                         help="create the outbox partitioned by day (new databases only; see README)")
    migrate.add_argument("--debezium-table", metavar="TABLE", default=None,
                         help="also adopt an existing Debezium-style outbox table (id, aggregatetype, "
                              "aggregateid, type, payload): writers stay as they are")
    migrate.add_argument("--existing", choices=("published", "pending"), default="published",
                         help="with --debezium-table: the rows already in the table are 'published' "
                              "(default: Debezium delivered them) or 'pending' (relay them)")
    migrate.add_argument("--view", default=None,
                         help="name of the relay's view over --debezium-table (default: TABLE_relay); "
                              "run the relay with --table VIEW")
    migrate.add_argument("--topic-template", default=None,
                         help="topic of a Debezium row, with {aggregatetype}, {type}, {aggregateid} or {id} "
                              "fields (default: outbox.event.{aggregatetype})")
    migrate.add_argument("--cloudevents-source", default=None,
                         help="add CloudEvents binary-mode headers (ce_id, ce_type, ce_source, "
                              "ce_specversion, ce_time) with this ce_source")

    status = sub.add_parser("status", help="pending rows, oldest age and shard leases")
    _add_options(status, "status")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    cleanup = sub.add_parser("cleanup", help="delete published rows older than the retention")
    _add_options(cleanup, "cleanup")

    dead = sub.add_parser("dead-letters", help="list, show, requeue or purge dead-lettered rows")
    dead_sub = dead.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    dead_sub.required = True
    for action, text in (("list", "list dead letters"), ("show", "show one dead letter"),
                         ("requeue", "put dead letters back into the outbox (same event_id)"),
                         ("purge", "delete dead letters for good")):
        p = dead_sub.add_parser(action, help=text)
        _add_options(p, "dead-letters")
        if action == "list":
            p.add_argument("--json", action="store_true", help="machine-readable output")
            p.add_argument("--limit", type=int, default=100)
        else:
            p.add_argument("event_ids", nargs="*", metavar="EVENT_ID")
            if action != "show":
                p.add_argument("--all", action="store_true", help="every dead letter")

    replay = sub.add_parser("replay", help="republish retained rows in commit order; list or cancel replays")
    _add_options(replay, "replay")
    from relay import replay_admin

    replay_admin.add_arguments(replay)

    console = sub.add_parser("console", help="a small web console (127.0.0.1, read-only by default)")
    _add_options(console, "console")

    demo = sub.add_parser("demo", help="embedded PostgreSQL + broker, a writer, the relay, a checker")
    _add_options(demo, "demo")
    demo.add_argument("--duration-s", type=float, default=20.0, help="how long the writer writes")
    demo.add_argument("--rate", type=float, default=500.0, help="events per second written")
    demo.add_argument("--keys", type=int, default=50, help="distinct keys")

    bench = sub.add_parser("bench", help="measure the relay against the database and producer floors")
    from relay import bench as bench_mod

    bench_mod.add_arguments(bench)
    for flag in ("--log-format", "--log-level"):
        option = OPTIONS[[o.flag for o in OPTIONS].index(flag)]
        bench.add_argument(flag, dest=option.name, default=None, help=option.help)
    return parser


def settings_from(args: argparse.Namespace, env: Mapping[str, str], command: str,
                  *, require_broker: bool) -> Any:
    values: dict[str, Any] = env_values(env, command)
    for option in OPTIONS:
        flag_value = getattr(args, option.name, None)
        if flag_value is not None:
            values[option.name] = flag_value
    kafka = kafka_env_properties(env)
    for text in getattr(args, "kafka_property", []) or []:
        name, value = parse_kafka_property(text)
        kafka[name] = value
    return build_settings(values, kafka_properties=kafka, require_broker=require_broker)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args, env)
    except RelayError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _configure_logs(args: argparse.Namespace, env: Mapping[str, str], command: str) -> None:
    from relay import logs
    from relay.config import _log_format, _log_level

    raw = env_values(env, command)
    fmt = args.log_format or raw.get("log_format", "auto")
    level = args.log_level or raw.get("log_level", "info")
    try:
        logs.configure(log_format=_log_format(fmt), level=_log_level(level))
    except ValueError as exc:
        raise ConfigError(f"--log-format/--log-level: {exc}") from None


def _dispatch(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    command = args.command
    _configure_logs(args, env, command)
    if command == "demo":
        from relay import demo

        return demo.main(args)
    if command == "bench":
        from relay import bench

        return bench.main(args, env)
    if command == "migrate" and args.print_sql:
        from relay import migrate

        shards = int(args.shards) if args.shards else migrate.DEFAULT_SHARDS
        sys.stdout.write(migrate.render(shards, partitioned=args.partitioned))
        return 0
    settings = settings_from(args, env, command, require_broker=command == "run")
    if command == "run":
        from relay.app import Relay, install_signal_handlers

        relay = Relay(settings)
        install_signal_handlers(relay)
        return relay.run()
    from relay import admin

    return admin.dispatch(command, args, settings)


if __name__ == "__main__":
    sys.exit(main())
