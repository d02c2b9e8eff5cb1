"""The options of `outbox-relay demo` and `bench`, checked when they are read, before any
database or broker starts.

A bad value ends the command with one line naming it (argparse's ``error:`` line, exit
code 2): ``--keys 0`` used to end a bench in a DivisionByZero traceback, ``--rate nan``
was taken, ``--json`` into a missing directory failed only once every figure had been
measured, and the demo's ``--rate 0`` killed its writer thread and still reported OK.
An external ``--dsn`` is tried once, with the relay's own reading of a failed connection
(relay/store.py), before the services start.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

import psycopg
import psycopg.conninfo

from relay.config import MAX_INT, MAX_SECONDS
from relay.store import connect, translate_connect_error

__all__ = ["BROKER_CHECK_S", "MAX_PAYLOAD_BYTES", "admin_dsn", "check_broker", "check_database",
           "json_path", "number", "plural", "seconds", "whole"]

#: How long an external --bootstrap-servers has to answer a metadata request at start.
BROKER_CHECK_S = 10.0

#: Under librdkafka's default message.max.bytes (1,000,000), with room for the key and
#: headers: a bigger row is dead-lettered by its size and a drain waits for it in vain.
MAX_PAYLOAD_BYTES = 900_000


def whole(least: int, most: int = MAX_INT, *, zero: str = "") -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``least`` to ``most``; ``zero`` says what 0
    means when it is allowed (shown in the message)."""
    bounds = f"of {least} or more" if most == MAX_INT else f"from {least} to {most}"
    if zero:
        bounds += f" ({zero})"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number {bounds}")
        return value

    return parse


def number(*, zero: str = "") -> Callable[[str], float]:
    """An argparse ``type``: a finite number above 0 (a rate); 0 too when ``zero`` says
    what it means."""
    bounds = f"of 0 or more ({zero})" if zero else "above 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number {bounds}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse ``type``: a duration, above 0 and finite (up to the relay's 100 years)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_SECONDS:  # False for nan
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds above 0, "
                                         "up to 100 years")
    return value


def json_path(text: str) -> str:
    """An argparse ``type``: a file the figures can be written to: its directory exists and
    this process may write there, and it is no directory itself."""
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: name a file in it")
    if not os.path.isdir(parent):
        missing = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r}: its directory {parent} {missing}")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} cannot be written by this process "
                                             f"(uid {os.getuid()})")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: its directory {parent} cannot be written by "
                                         f"this process (uid {os.getuid()})")
    return text


def admin_dsn(dsn: str) -> str:
    """The same server, database ``postgres`` (the bench creates one database per run); a
    DSN libpq cannot parse is the relay's ConfigError, its password masked."""
    try:
        return psycopg.conninfo.make_conninfo(dsn, dbname="postgres")
    except psycopg.ProgrammingError as exc:
        raise translate_connect_error(exc, dsn, option="--dsn") from None


def check_database(dsn: str, *, application_name: str) -> None:
    """Connect to ``dsn`` once and close: a failure is the relay's error for it (unreachable:
    exit code 1, rejected credentials: 4, a bad DSN: 2), in one masked line."""
    with connect(dsn, application_name=application_name, option="--dsn"):
        pass


def check_broker(bootstrap: str, *, timeout_s: float = BROKER_CHECK_S) -> None:
    """Ask ``bootstrap`` for the cluster's metadata once, before anything starts: a bench
    given a broker that is not there started its database, measured its floors, produced
    into nothing for two minutes and then waited out its first drain's ten.  One line (the
    relay's FatalError, exit code 1) naming the servers and the client's reason."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from relay.errors import FatalError

    # log_level 0: the client's own connection errors are summed up in the line below.
    client = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        client.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        raise FatalError(f"--bootstrap-servers {bootstrap}: no Kafka broker answered within "
                         f"{timeout_s:g} s ({reason})") from None


def plural(count: int, word: str) -> str:
    """``1 row``, ``2 rows``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"
