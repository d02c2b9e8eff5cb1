"""Input that is not UTF-8 text, found before it reaches a parser.

Python decodes the command line and the environment with ``surrogateescape``: bytes that
are not UTF-8 become lone surrogates, and the first library that encodes the string
again (psycopg's conninfo, librdkafka's configuration, a query parameter) raises where a
person reads only a traceback.  The CLIs call :func:`first_undecodable` first and refuse
such input in one line that names where it is, never what it is (it may be a secret).

:func:`refuse_unstorable` refuses what PostgreSQL cannot store (a NUL character, a lone
surrogate), for the SDK's checks of events and jobs before they are sent.

:func:`uuid_from_text` reads a UUID's text the one way every id is read (an event's, a
run's, a console address's), before it reaches PostgreSQL's uuid input;
:func:`valid_topic_name` is Kafka's rule for a topic's name, for the SDK's events and
options and the relay's.  :func:`has_colliding_keys` finds what jsonb would collapse, for
the SDK's event payloads and job payloads alike.  :func:`bootstrap_servers_problem` reads
a Kafka cluster's address list before librdkafka would, for the relay and the SDK.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

#: A NUL escaped by json.dumps: ``\u0000`` after an even number of backslashes (``\\u0000``
#: is a backslash and the text "u0000", which jsonb takes).
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


#: A UUID's text as PostgreSQL's uuid input reads it: 32 hex digits, with or without the
#: usual hyphens, optionally in braces; either case.  (Python's uuid.UUID also takes a
#: "urn:uuid:" prefix and hyphens anywhere, which PostgreSQL refuses.)
_UUID = re.compile(r"(\{)?[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}(?(1)\})")


_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def valid_topic_name(value: object) -> TypeGuard[str]:
    """Kafka's rule for a topic name (the outbox's CHECK): 1-249 of [A-Za-z0-9._-], not "."
    or "..", matched whole (a trailing newline is not one)."""
    return isinstance(value, str) and _TOPIC_NAME.fullmatch(value) is not None and value not in (".", "..")


def uuid_from_text(value: object) -> uuid.UUID | None:
    """The UUID that ``value``'s text names, or None when it is not a str of that form."""
    if isinstance(value, str) and _UUID.fullmatch(value):
        return uuid.UUID(value)
    return None


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def first_undecodable(argv: Sequence[str], env: Mapping[str, str], prefix: str) -> str | None:
    """Where the first input that is not UTF-8 text is: a variable named ``prefix...``, or
    a command-line argument (by its flag when there is one); None when all of it is."""
    for name in sorted(env):
        if name.startswith(prefix) and not (is_utf8(name) and is_utf8(env[name])):
            return f"the environment variable {name!r}" if not is_utf8(name) else name
    for index, arg in enumerate(argv):
        if is_utf8(arg):
            continue
        flag, sep, _value = arg.partition("=")
        if flag.startswith("-") and sep and is_utf8(flag):
            return f"the value of {flag}"
        before = argv[index - 1] if index else ""
        if before.startswith("-") and "=" not in before and is_utf8(before):
            return f"the value after {before}"
        return f"command-line argument {index + 1}"
    return None


def refuse_unstorable(name: str, text: str, error: type[Exception], *, json: bool = False) -> str:
    """``text`` unchanged, or ``error`` naming ``name`` when PostgreSQL cannot store it: a NUL
    character (in JSON text, an escaped one: jsonb refuses ``\\u0000``) or a lone surrogate."""
    if ("\\u0000" in text and _JSON_NUL.search(text)) if json else "\x00" in text:
        raise error(f"{name} must not contain NUL characters (PostgreSQL cannot store them)")
    if not text.isascii() and not is_utf8(text):
        raise error(f"{name} is not valid UTF-8 text (it holds a lone surrogate)")
    return text


#: JSON's scalars, skipped at the cost of a set lookup: most of a payload's values.
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _json_key(key: Any) -> Any:
    """The object key json.dumps writes for ``key`` (str, int, float, bool, None)."""
    return key if isinstance(key, str) else json.dumps(key)


def has_colliding_keys(value: Any) -> bool:
    """True when ``value`` (something json.dumps encoded) holds a dict whose keys collide once
    json.dumps turns them into strings (``{1: "a", "1": "b"}``): jsonb would keep only the
    last.  Iterative: no depth limit.  On every write_event's path: 5.5-7.6 us for a 512-byte
    payload of 13 objects, where the walk first written took 18-20 us (json.dumps itself takes
    about 12)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if type(node) in _SCALARS:
            continue
        if isinstance(node, dict):
            for key in node:
                if not isinstance(key, str):  # only then can two keys collide as strings
                    if len({_json_key(k) for k in node}) != len(node):
                        return True
                    break
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return False


#: One entry of bootstrap.servers: an optional listener's protocol, a host (an IPv6
#: address in brackets) and an optional port.
_BROKER = re.compile(r"(?:[A-Za-z_]+://)?(?P<host>\[[0-9A-Fa-f:.%\w]+\]|[^\s:/\[\]]+)(?::(?P<port>[^:]*))?")


def bootstrap_servers_problem(value: object) -> str | None:
    """What is wrong with a bootstrap.servers list (``host:port,host:port``), or None.

    librdkafka takes anything and reports it only while connecting, the same way as a
    cluster that is down ("No brokers configured" for a blank entry, a connection to
    port 0 for ``host:abc``, to a port taken modulo 65536 for ``host:99999``), so a relay
    retried for ever and an SDK consumer reported it as the cluster being unavailable."""
    if not isinstance(value, str):
        return f"must be a string of host:port pairs, not {type(value).__name__}"
    entries = [e.strip() for e in value.split(",")]
    if not any(entries):
        return "names no broker (host:port, comma-separated)"
    for entry in entries:
        if not entry:
            continue  # "a,,b": librdkafka skips it
        match = _BROKER.fullmatch(entry)
        if match is None:
            if entry.count(":") > 1 and "[" not in entry and not any(c.isspace() for c in entry):
                continue  # a bare IPv6 address: librdkafka's to read
            return f"{entry!r} is not host:port"
        port = match.group("port")
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            return f"{entry!r}: {port!r} is not a TCP port (1-65535)"
    return None


def lacks_token_source(props: Mapping[str, Any]) -> bool:
    """True for librdkafka properties that choose SASL OAUTHBEARER without a token source
    (``sasl.oauthbearer.method=oidc``, ``enable.sasl.oauthbearer.unsecure.jwt=true``, or a
    callable ``oauth_cb``): librdkafka then waits for a token that never comes, and the
    client sends nothing and says nothing (an audit of the security paths)."""
    mechanism = str(props.get("sasl.mechanism", props.get("sasl.mechanisms", ""))).strip().upper()
    return (mechanism == "OAUTHBEARER" and not callable(props.get("oauth_cb"))
            and str(props.get("sasl.oauthbearer.method", "default")).strip().lower() != "oidc"
            and str(props.get("enable.sasl.oauthbearer.unsecure.jwt", "")).strip().lower() not in ("true", "1"))


# Control characters but newline and tab, and the invisible ones that reorder or hide text
# (bidirectional overrides and isolates, zero-width characters, the byte-order mark).
_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")


def visible(text: str) -> str:
    """``text`` with control and invisible characters as ``\\u202e``-style escapes, for a
    person to read (a terminal, a web page): an error holding ``ESC [2J`` cleared an
    operator's terminal, a right-to-left override showed an id backwards."""
    return _HIDDEN.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
