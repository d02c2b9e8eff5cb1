"""Where raw option values come from: the environment, secret files and ``--kafka-property``.

:func:`env_values` is the ONE env mapping; ``OUTBOX_RELAY_KAFKA_<PROPERTY>`` variables and
``NAME=VALUE`` flags give librdkafka properties; ``<VARIABLE>_FILE`` reads a secret from a file.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path

from outbox_core.secrets import mask_text
from relay.errors import ConfigError
from relay.options import ENV_PREFIX, KAFKA_ENV_PREFIX, OPTIONS

_KAFKA_PROPERTY = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")


def read_secret_file(env: Mapping[str, str], name: str) -> str | None:
    """``NAME_FILE`` names a file whose content (stripped of one trailing newline) is the value."""
    path = env.get(name + "_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\n")
    except OSError as exc:
        raise ConfigError(f"{name}_FILE: cannot read {path}: {exc.strerror}") from None
    except ValueError:  # not UTF-8, or a NUL in the path; the content is never echoed
        raise ConfigError(f"{name}_FILE: {path!r} is not a readable UTF-8 text file") from None


def secret_from_file(env: Mapping[str, str], name: str) -> str:
    """``NAME_FILE``'s content, when it is set: the same rules for every secret's file (the
    DSN's, the console token's, a Kafka property's).  With ``NAME`` set too, one was meant to
    replace the other, and which one is in use is a guess (an empty variable beside its file
    hid the file: "no database given"; a Kafka property's pair took whichever the environment
    listed last); an empty file is a mount gone wrong, not an empty password."""
    if env.get(name):
        raise ConfigError(f"set one of {name} or {name}_FILE, not both")
    value = read_secret_file(env, name)
    if not (value or "").strip():
        raise ConfigError(f"{name}_FILE: {env[name + '_FILE']} is empty")
    return value or ""


#: What Kubernetes sets for a Service of the same name (enableServiceLinks): OUTBOX_RELAY_PORT,
#: OUTBOX_RELAY_SERVICE_HOST, OUTBOX_RELAY_PORT_9464_TCP_ADDR ... are no typing mistakes.
_SERVICE_LINK = re.compile(r"(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_\w+)?)?)")


def unknown_env_variables(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``OUTBOX_RELAY_*`` variables that are no option of any command, each with the known one
    it most resembles (or None): a misspelt ``OUTBOX_RELAY_EXACTLY_ONC=true`` was ignored in
    silence, where a misspelt flag is refused.  Only warned about (relay/cli.py): another
    tool's variable may share the prefix."""
    known = {option.env for option in OPTIONS}
    known |= {option.env + "_FILE" for option in OPTIONS if option.secret}
    suffixes = sorted(k[len(ENV_PREFIX):] for k in known)
    found = []
    for name in sorted(env):
        if (not name.startswith(ENV_PREFIX) or name.startswith(KAFKA_ENV_PREFIX) or name in known
                or _SERVICE_LINK.fullmatch(name[len(ENV_PREFIX):])):
            continue
        close = difflib.get_close_matches(name[len(ENV_PREFIX):], suffixes, n=1, cutoff=0.75)
        found.append((name, ENV_PREFIX + close[0] if close else None))
    return found


def env_values(env: Mapping[str, str], command: str) -> dict[str, str]:
    """The raw option values found in the environment: the ONE env mapping."""
    found: dict[str, str] = {}
    for option in OPTIONS:
        if command not in option.commands:
            continue
        value = env.get(option.env)
        if option.secret and env.get(option.env + "_FILE"):
            value = secret_from_file(env, option.env)
        if value is not None and value != "":
            found[option.name] = value
    return found


def kafka_env_properties(env: Mapping[str, str]) -> dict[str, str]:
    """``OUTBOX_RELAY_KAFKA_SASL_PASSWORD`` -> ``{"sasl.password": ...}`` (``_FILE`` too)."""
    props: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith(KAFKA_ENV_PREFIX):
            continue
        prop = name[len(KAFKA_ENV_PREFIX) :].lower()
        if not prop.strip("_") or prop == "_file":  # librdkafka: 'No such configuration property: ""'
            raise ConfigError(f"{name} names no Kafka property ({KAFKA_ENV_PREFIX}<PROPERTY>, "
                              f"e.g. {KAFKA_ENV_PREFIX}SECURITY_PROTOCOL)")
        if prop.endswith("_file"):
            if value:
                props[prop[: -len("_file")].replace("_", ".")] = secret_from_file(env, name[: -len("_FILE")])
            continue
        if env.get(name + "_FILE"):
            continue  # the pair is its _FILE's to refuse (secret_from_file)
        props[prop.replace("_", ".")] = value
    return props


def parse_kafka_property(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> (name, value).  An error names the property, never the value."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not _KAFKA_PROPERTY.match(name):
        # Without "=" the whole text may be a secret pasted in the wrong place.
        got = f"the name {mask_text(name)!r}" if sep else "no '='"
        raise ConfigError(
            f"--kafka-property expects NAME=VALUE with a librdkafka property name, got {got}"
        )
    return name, value

