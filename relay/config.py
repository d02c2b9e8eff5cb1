"""Settings: one frozen, keyword-only object, validated once at start.

Every option is a flag and an environment variable ``OUTBOX_RELAY_<NAME>``;
the table :data:`OPTIONS` is the single source of both, and of ``--help``.
librdkafka properties pass through as ``OUTBOX_RELAY_KAFKA_<PROPERTY>``
(``OUTBOX_RELAY_KAFKA_SECURITY_PROTOCOL`` becomes ``security.protocol``) or as
repeated ``--kafka-property NAME=VALUE`` flags.  A secret can be read from a
file named by ``<VARIABLE>_FILE``, as Kubernetes mounts secrets.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox_core.secrets import InvalidDsn

# One masking for the relay and the SDK: the four imported "as" themselves are re-exported
# (relay code imports them from here); validate_dsn and valid_topic_name are this module's.
from outbox_core.secrets import is_secret as is_secret
from outbox_core.secrets import mask_dsn as mask_dsn
from outbox_core.secrets import mask_text as mask_text
from outbox_core.secrets import masked_properties as masked_properties
from outbox_core.secrets import validate_dsn as _validate_dsn
from outbox_core.text import bootstrap_servers_problem, lacks_token_source, valid_topic_name
from relay.errors import ConfigError

ENV_PREFIX = "OUTBOX_RELAY_"
KAFKA_ENV_PREFIX = ENV_PREFIX + "KAFKA_"

DEFAULT_BATCH_SIZE = 1000
DEFAULT_BATCH_MAX_BYTES = 4 << 20  # 4 MiB of messages per batch, 16 MiB in flight by default
DEFAULT_POLL_INTERVAL_S = 1.0
#: After a claim that caught up, the next one waits at least this long, at most the
#: maximum: the pump stretches the wait while claims find only a few rows (a steady trickle
#: is claimed a few rows at a time, not one claim per row) and shortens it as they fill.
DEFAULT_CLAIM_INTERVAL_S = 0.005
DEFAULT_CLAIM_INTERVAL_MAX_S = 0.08  # 100 events/s: 8 rows a claim, 12.5 claims/s
DEFAULT_METRICS_PORT = 9464
DEFAULT_CONSOLE_HOST = "127.0.0.1"
DEFAULT_CONSOLE_PORT = 8089
DEFAULT_METRICS_HOST = "0.0.0.0"  # noqa: S104 - a sidecar's probes come from the kubelet
DEFAULT_LEASE_DURATION_S = 10.0
DEFAULT_PIPELINE_DEPTH = 4
#: Connections marking at once (0: automatic, see :func:`mark_connections`).  Two paid while
#: a mark cost 20-30 us a row (relay-shaped database floor 32,262 -> 53,081 rows/s); since
#: migration 0010 made the mark 2.5 x cheaper, a second mark connection only competes with
#: the claim and the broker for the cores: the drain with one, 57,564 events/s, with two
#: 51,595 (6 rounds alternating, one better in each; issue 18's twelfth pass).  In
#: exactly-once mode the shards' Kafka transactions bound the drain: one there too.
DEFAULT_MARK_CONNECTIONS = 1
DEFAULT_EXACTLY_ONCE_MARK_CONNECTIONS = 1
MAX_MARK_CONNECTIONS = 8
DEFAULT_DRAIN_TIMEOUT_S = 15.0
DEFAULT_LOCK_TIMEOUT_S = 5.0  # migrate: the longest a migration's lock request holds writers up
DEFAULT_BACKOFF_INITIAL_S = 0.2
DEFAULT_BACKOFF_MAX_S = 30.0
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_STUCK_AFTER_S = 120.0
DEFAULT_BACKLOG_INTERVAL_S = 5.0
DEFAULT_CLEANUP_INTERVAL_S = 60.0
DEFAULT_CLEANUP_BATCH = 1000
DEFAULT_EXACTLY_ONCE_POSITION_TOPIC = "outbox-relay.positions"  # exactly-once mode (issue 20)
DEFAULT_EXACTLY_ONCE_TRANSACTIONAL_ID_PREFIX = "outbox-relay."
#: A batch settles when the transactions of all its shards commit: more batches in flight.
DEFAULT_EXACTLY_ONCE_PIPELINE_DEPTH = 16
#: A shard's next transaction starts this long after its last one at the earliest (unless its
#: rows fill one): fewer, fuller transactions at steady rates, as Kafka Streams' default
#: commit.interval.ms (100) does under exactly-once.
DEFAULT_EXACTLY_ONCE_COMMIT_INTERVAL_S = 0.1

#: librdkafka settings the relay needs for its guarantees; a user may override
#: the tuning ones but not these (see :func:`producer_config`).
REQUIRED_PRODUCER = {"enable.idempotence": "true", "acks": "all"}
#: librdkafka's properties known under two names (rdkafka_conf.c): canonical -> alias.  Its
#: errors name the canonical one (relay/publisher.py names the alias the user wrote), and
#: a required property may be given under either.
KAFKA_ALIASES = {"queue.buffering.max.ms": "linger.ms", "message.send.max.retries": "retries",
                 "max.in.flight.requests.per.connection": "max.in.flight",
                 "compression.codec": "compression.type", "request.required.acks": "acks",
                 "message.timeout.ms": "delivery.timeout.ms"}
#: The values librdkafka reads as the required one (acks=-1 is all; enable.idempotence=1 is true).
_REQUIRED_EQUIVALENTS = {"enable.idempotence": {"true", "1"}, "acks": {"all", "-1"}}
DEFAULT_PRODUCER = {
    "partitioner": "murmur2_random",  # keys land on the same partitions as with Java clients
    # Fuller record batches in a backlog, at no latency once caught up: after a paced claim
    # the pump waits for its rows' reports with the client's flush, which sends what is
    # queued at once whatever linger.ms says (relay/pump.py, Pump.wait).  Against 1 ms,
    # issue 18's twenty-seventh pass measured the drain 1.13 x faster and the relay's CPU
    # 0.80 x a row, commit -> ack unchanged at 1,000 and 5,000 events/s; 10 and 20 ms
    # drained slower than 5 (batches wait while the pipeline has room).
    "linger.ms": "5",
    "compression.type": "none",
}

#: linger.ms when claims are not paced (--claim-interval-s 0): the pump then waits for reports
#: without the client's flush, so a caught-up relay's rows would wait the whole linger.
UNPACED_LINGER_MS = "1"

_KAFKA_PROPERTY = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")


@dataclass(frozen=True, kw_only=True)
class Option:
    """One setting: its flag, environment variable, parser and help."""

    name: str  # attribute of Settings, e.g. "poll_interval_s"
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    secret: bool = False
    commands: tuple[str, ...] = ("run",)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


#: Upper bounds that no real setting comes near: past them a value reached the database as a
#: LIMIT or an interval it cannot hold, and the relay died on a traceback after it had started.
MAX_INT = 2**31 - 1
MAX_SHARDS = 4096  # outbox_relay_settings' CHECK (migration 0002)
MAX_SECONDS = 100 * 365 * 86400.0


def _positive_int(text: str) -> int:
    value = int(text)
    if not 0 < value <= MAX_INT:
        raise ValueError(f"must be a positive integer up to {MAX_INT}")
    return value


def _shard_count(text: str) -> int:
    """1 to 4096, the settings table's CHECK: past it `migrate --shards` applied every
    migration, then failed on the CHECK with a traceback and left no settings row."""
    value = int(text)
    if not 1 <= value <= MAX_SHARDS:
        raise ValueError(f"must be a shard count from 1 to {MAX_SHARDS}")
    return value


def _mark_connections(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_MARK_CONNECTIONS:
        raise ValueError(f"must be an integer from 0 (automatic) to {MAX_MARK_CONNECTIONS}")
    return value


#: The shortest duration an option takes: 1e-300 s of poll interval kept an idle relay on a
#: full core, and a lease that short flooded the log with heartbeat_late.
MIN_SECONDS = 0.001
#: The shortest lease: renewing it takes database round trips.
MIN_LEASE_S = 1.0


def _positive_float(text: str) -> float:
    value = float(text)
    if not MIN_SECONDS <= value <= MAX_SECONDS:
        raise ValueError(f"must be a number of seconds from {MIN_SECONDS:g} to 100 years")
    return value


def _lease_seconds(text: str) -> float:
    value = float(text)
    if not MIN_LEASE_S <= value <= MAX_SECONDS:
        raise ValueError(f"must be a number of seconds from {MIN_LEASE_S:g} to 100 years")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= MAX_SECONDS:
        raise ValueError("must be a number of seconds, 0 or more, up to 100 years")
    return value


def _flag(text: str) -> bool:
    """An empty value is refused: `--keep-published=` read as false deleted every row as it
    was acknowledged (an empty variable is unset: the default)."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port between 0 and 65535")
    return value


MAX_OWNER_CHARS = 253  # a Kubernetes pod name (metadata.name) or a host name may be this long


def _bind_host(text: str) -> str:
    """An address to listen on.  An empty one was taken as every interface, and the
    console's check of the Host header (against DNS rebinding) then allowed any name."""
    host = text.strip()
    if not host or any(c.isspace() for c in host):
        raise ValueError("must be a host name or IP address to listen on "
                         "(0.0.0.0 or :: for every interface)")
    return host


def _owner(text: str) -> str:
    """A replica's name: in leases, status, logs and the console.  A name of 9,950
    characters overflowed the connection's start-up packet (through application_name), and
    the relay took the refusal for a database outage, retried for ever."""
    owner = text.strip()
    if not 0 < len(owner) <= MAX_OWNER_CHARS or not owner.isprintable():
        raise ValueError(f"must be 1-{MAX_OWNER_CHARS} printable characters")
    return owner


def _log_format(text: str) -> str:
    if text not in ("auto", "json", "console"):
        raise ValueError("must be one of auto, json, console")
    return text


_TABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}(\.[A-Za-z_][A-Za-z0-9_$]{0,62})?\Z")


def _table_name(text: str) -> str:
    if not _TABLE.match(text):
        raise ValueError("must be a table name, optionally schema-qualified (schema.table)")
    return text


def _topic_name(text: str) -> str:
    """Kafka's rule (the outbox's CHECK): an empty position topic was a broker_unavailable
    retried for ever ("cannot read metadata of : ...")."""
    if not valid_topic_name(text):
        raise ValueError("must be a Kafka topic name: 1 to 249 of A-Z a-z 0-9 . _ -")
    return text


def _log_level(text: str) -> str:
    level = text.lower()
    if level not in ("debug", "info", "warning", "error"):
        raise ValueError("must be one of debug, info, warning, error")
    return level


DB_COMMANDS = ("run", "migrate", "status", "cleanup", "dead-letters", "replay", "console")

OPTIONS: tuple[Option, ...] = (
    Option(name="dsn", help="PostgreSQL connection string (libpq URI or key=value)",
           secret=True, commands=DB_COMMANDS),
    Option(name="bootstrap_servers", help="Kafka bootstrap servers, host:port[,host:port]"),
    Option(name="batch_size", parse=_positive_int, default=DEFAULT_BATCH_SIZE,
           help="rows claimed per batch"),
    Option(name="poll_interval_s", parse=_positive_float, default=DEFAULT_POLL_INTERVAL_S,
           help="fallback poll interval when no notification arrives, seconds"),
    Option(name="claim_interval_s", parse=_seconds, default=DEFAULT_CLAIM_INTERVAL_S,
           help="after a claim that found the backlog drained, the next claim waits at least "
                "this long (0: at once); a full batch is followed at once"),
    Option(name="claim_interval_max_s", parse=_seconds, default=DEFAULT_CLAIM_INTERVAL_MAX_S,
           help="the longest wait after a drained claim, reached while claims find only a "
                "few rows: bounds the latency a low write rate pays for a cheap relay"),
    Option(name="pipeline_depth", parse=_positive_int, default=DEFAULT_PIPELINE_DEPTH,
           help="batches in flight to the broker at once"),
    Option(name="mark_connections", parse=_mark_connections, default=0,
           help="connections marking acknowledged rows at once while draining (a shard's "
                "marks stay in order; a second opens only when a large batch is split); "
                f"0: {DEFAULT_MARK_CONNECTIONS}, or {DEFAULT_EXACTLY_ONCE_MARK_CONNECTIONS} "
                "with --exactly-once"),
    Option(name="batch_max_bytes", parse=_positive_int, default=DEFAULT_BATCH_MAX_BYTES,
           help="message bytes (payload, key, headers) per batch, and in flight for replays: "
                "memory is bounded by bytes, not rows (rows over the producer's "
                "message.max.bytes are dead-lettered by size, never fetched)"),
    Option(name="metrics_port", parse=_port, default=DEFAULT_METRICS_PORT,
           help="port of /metrics, /healthz, /readyz and /startupz (0 disables)"),
    Option(name="metrics_host", parse=_bind_host, default=DEFAULT_METRICS_HOST,
           help="address the metrics/health server binds to"),
    Option(name="log_format", parse=_log_format, default="auto",
           help="auto (JSON unless stdout is a terminal), json or console",
           commands=("run", "migrate", "status", "cleanup", "dead-letters", "demo", "replay",
                     "console")),
    Option(name="log_level", parse=_log_level, default="info", help="debug, info, warning or error",
           commands=("run", "migrate", "status", "cleanup", "dead-letters", "demo", "replay",
                     "console")),
    Option(name="owner", parse=_owner, default=None,
           help="this replica's name in leases and status (default: host name and pid)"),
    Option(name="table", parse=_table_name, default="outbox",
           help="the outbox table, or the view `migrate --debezium-table` made over another table",
           commands=("run", "status", "cleanup", "dead-letters", "replay", "console")),
    Option(name="shards", parse=_shard_count, default=None,
           help="shard count; must match the database's (set by migrate --shards)",
           commands=("run", "migrate")),
    Option(name="lock_timeout_s", parse=_positive_float, default=DEFAULT_LOCK_TIMEOUT_S,
           help="migrate: how long a migration waits for a table lock before it gives up and "
                "tries again (3 tries); writers queue behind that wait, so keep it short",
           commands=("migrate",)),
    Option(name="lease_duration_s", parse=_lease_seconds, default=DEFAULT_LEASE_DURATION_S,
           help="how long a shard lease lasts without renewal, seconds"),
    Option(name="heartbeat_interval_s", parse=_positive_float, default=None,
           help="lease renewal interval, seconds (default: a third of the lease)"),
    Option(name="drain_timeout_s", parse=_positive_float, default=DEFAULT_DRAIN_TIMEOUT_S,
           help="on SIGTERM, how long to wait for in-flight acknowledgements, seconds"),
    Option(name="max_attempts", parse=_positive_int, default=DEFAULT_MAX_ATTEMPTS,
           help="permanent publish failures of a row before it is dead-lettered"),
    Option(name="dead_letter_topic", default=None, parse=_topic_name,
           help="also produce dead-lettered rows to this topic (with dlt_* headers) before moving them"),
    Option(name="backoff_max_s", parse=_positive_float, default=DEFAULT_BACKOFF_MAX_S,
           help="cap of the exponential back-off for retries, seconds"),
    Option(name="stuck_after_s", parse=_positive_float, default=DEFAULT_STUCK_AFTER_S,
           help="/healthz fails when rows are pending, the database and the broker are up, and "
                "nothing was published for this long (counted from the later of the last publish "
                "and their return)"),
    Option(name="cleanup_retention_s", parse=_positive_float, default=None,
           help="when set, run deletes published rows older than this, seconds",
           commands=("run", "cleanup")),
    Option(name="keep_published", parse=_flag, default="true", commands=("run",),
           help="keep published rows, marked with published_at, for replays and the "
                "retention cleanup; false deletes each row once the broker acknowledged it "
                "(about 10x less database work per row; nothing left to replay from)"),
    Option(name="cleanup_interval_s", parse=_positive_float, default=DEFAULT_CLEANUP_INTERVAL_S,
           help="how often run's built-in cleanup runs, seconds"),
    Option(name="cleanup_batch", parse=_positive_int, default=DEFAULT_CLEANUP_BATCH,
           help="rows deleted per cleanup statement (short locks)", commands=("run", "cleanup")),
    # Exactly-once mode (issue 20, relay/exactly_once.py).
    Option(name="exactly_once", parse=_flag, default="false",
           help="Kafka transactions fenced by the shard leases: read_committed consumers see "
                "every row once (needs transactions and a position topic; see README)"),
    Option(name="exactly_once_position_topic", default=DEFAULT_EXACTLY_ONCE_POSITION_TOPIC, parse=_topic_name,
           help="compacted topic (one partition per shard) where each transaction records "
                "the rows it carried"),
    Option(name="exactly_once_transactional_id_prefix",
           default=DEFAULT_EXACTLY_ONCE_TRANSACTIONAL_ID_PREFIX,
           help="transactional.id of a shard's producer: <prefix><table>.<shard>"),
    Option(name="exactly_once_pipeline_depth", parse=_positive_int,
           default=DEFAULT_EXACTLY_ONCE_PIPELINE_DEPTH,
           help="batches in flight in exactly-once mode (replaces --pipeline-depth there)"),
    Option(name="exactly_once_commit_interval_s", parse=_seconds,
           default=DEFAULT_EXACTLY_ONCE_COMMIT_INTERVAL_S,
           help="the shortest time between the starts of a shard's transactions in exactly-once "
                "mode (0: back to back); a shard with 1,000 rows waiting starts at once"),
    Option(name="console_host", parse=_bind_host, default=DEFAULT_CONSOLE_HOST, commands=("console",),
           help="address the console binds to (only this machine unless told otherwise)"),
    Option(name="console_port", parse=_port, default=DEFAULT_CONSOLE_PORT, commands=("console",),
           help="port of the console (0: any free port, printed at start)"),
    Option(name="console_actions", parse=_flag, default="false", commands=("console",),
           help="allow actions (requeue, purge, cancel, retry); read-only when false"),
    Option(name="console_token", secret=True, default=None, commands=("console",),
           help="the token an operator enters to run actions (needed with --console-actions)"),
)

OPTIONS_BY_NAME = {option.name: option for option in OPTIONS}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Validated relay settings.  Units are in the names."""

    dsn: str
    bootstrap_servers: str = ""
    kafka_properties: Mapping[str, str] = field(default_factory=dict)
    batch_size: int = DEFAULT_BATCH_SIZE
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    claim_interval_s: float = DEFAULT_CLAIM_INTERVAL_S
    claim_interval_max_s: float = DEFAULT_CLAIM_INTERVAL_MAX_S
    pipeline_depth: int = DEFAULT_PIPELINE_DEPTH
    mark_connections: int = 0  # automatic: see mark_connections()
    batch_max_bytes: int = DEFAULT_BATCH_MAX_BYTES
    metrics_port: int = DEFAULT_METRICS_PORT
    metrics_host: str = DEFAULT_METRICS_HOST
    log_format: str = "auto"
    log_level: str = "info"
    owner: str = ""
    table: str = "outbox"
    shards: int | None = None
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    lease_duration_s: float = DEFAULT_LEASE_DURATION_S
    heartbeat_interval_s: float = DEFAULT_LEASE_DURATION_S / 3
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    dead_letter_topic: str | None = None
    backoff_initial_s: float = DEFAULT_BACKOFF_INITIAL_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S
    stuck_after_s: float = DEFAULT_STUCK_AFTER_S
    backlog_interval_s: float = DEFAULT_BACKLOG_INTERVAL_S
    cleanup_retention_s: float | None = None
    cleanup_interval_s: float = DEFAULT_CLEANUP_INTERVAL_S
    cleanup_batch: int = DEFAULT_CLEANUP_BATCH
    console_host: str = DEFAULT_CONSOLE_HOST
    console_port: int = DEFAULT_CONSOLE_PORT
    console_actions: bool = False
    console_token: str | None = None
    exactly_once: bool = False
    keep_published: bool = True
    exactly_once_position_topic: str = DEFAULT_EXACTLY_ONCE_POSITION_TOPIC
    exactly_once_transactional_id_prefix: str = DEFAULT_EXACTLY_ONCE_TRANSACTIONAL_ID_PREFIX
    exactly_once_pipeline_depth: int = DEFAULT_EXACTLY_ONCE_PIPELINE_DEPTH
    exactly_once_commit_interval_s: float = DEFAULT_EXACTLY_ONCE_COMMIT_INTERVAL_S

    def __repr__(self) -> str:  # never print secrets, whatever prints this object
        return f"Settings(dsn={mask_dsn(self.dsn)!r}, bootstrap_servers={self.bootstrap_servers!r}, owner={self.owner!r})"


def default_owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


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


#: What gave the relay its DSN, named when libpq refuses the string or a value in it (here,
#: before connecting, and by relay/store.py when libpq refuses it only as it connects).
DSN_OPTION = f"--dsn / {ENV_PREFIX}DSN"


def validate_dsn(dsn: str) -> None:
    """Reject what libpq would only reject at connect time, with the option named
    (outbox_core.secrets.validate_dsn, the SDK's check too)."""
    try:
        _validate_dsn(dsn, option=DSN_OPTION)
    except InvalidDsn as exc:
        raise ConfigError(str(exc)) from None


def parse_option(name: str, raw: Any) -> Any:
    """One option's raw value (a string from a flag or the environment) parsed as the option
    says; a bad one is a ConfigError that names the flag and the variable."""
    option = OPTIONS_BY_NAME[name]
    if not isinstance(raw, str) or option.parse is str:
        return raw
    try:
        return option.parse(raw)
    except ValueError as exc:
        reason = str(exc)
        if reason.startswith("invalid literal for int()"):  # Python's words, not the user's
            reason = "is not a whole number"
        elif reason.startswith("could not convert string to float"):
            reason = "is not a number"
        raise ConfigError(f"{option.flag} / {option.env}: {raw!r} {reason}") from None


def build_settings(
    values: Mapping[str, Any],
    *,
    kafka_properties: Mapping[str, str] | None = None,
    require_broker: bool = True,
) -> Settings:
    """Parse and validate raw option values (strings from env or flags) into Settings."""
    parsed = {name: parse_option(name, raw) for name, raw in values.items() if raw is not None}
    dsn = parsed.get("dsn")
    if not dsn or not dsn.strip():  # blank: libpq would try the local socket's defaults
        raise ConfigError(f"no database given: set --dsn, {ENV_PREFIX}DSN or {ENV_PREFIX}DSN_FILE")
    validate_dsn(dsn)
    if require_broker and not parsed.get("bootstrap_servers"):
        props = kafka_properties or {}
        if "bootstrap.servers" in props:
            parsed["bootstrap_servers"] = props["bootstrap.servers"]
        else:
            raise ConfigError(
                f"no Kafka cluster given: set --bootstrap-servers or {ENV_PREFIX}BOOTSTRAP_SERVERS"
            )
    if parsed.get("bootstrap_servers"):
        problem = bootstrap_servers_problem(parsed["bootstrap_servers"])
        if problem is not None:  # librdkafka would retry it for ever, as a cluster that is down
            raise ConfigError(f"--bootstrap-servers / {ENV_PREFIX}BOOTSTRAP_SERVERS {problem}")
    lease = parsed.get("lease_duration_s", DEFAULT_LEASE_DURATION_S)
    heartbeat = parsed.get("heartbeat_interval_s") or lease / 3
    if heartbeat >= lease:
        raise ConfigError(
            f"--heartbeat-interval-s ({heartbeat}) must be shorter than --lease-duration-s ({lease})"
        )
    parsed["heartbeat_interval_s"] = heartbeat
    low = parsed.get("claim_interval_s", DEFAULT_CLAIM_INTERVAL_S)
    high = parsed.get("claim_interval_max_s", DEFAULT_CLAIM_INTERVAL_MAX_S)
    if low and high and low > high:  # the pacing's floor above its ceiling: one was mistyped
        raise ConfigError(f"--claim-interval-s ({low:g}) must not be above --claim-interval-max-s ({high:g})")
    if parsed.get("keep_published") is False and parsed.get("cleanup_retention_s"):
        raise ConfigError(
            "--keep-published false deletes rows as they are published: there is nothing for "
            "--cleanup-retention-s to keep; set one or the other"
        )
    parsed["owner"] = parsed.get("owner") or default_owner()
    if kafka_properties:
        parsed["kafka_properties"] = dict(kafka_properties)
    return Settings(**parsed)


def ignored_options(settings: Settings) -> list[str]:
    """The --exactly-once-* options set away from their defaults while the mode is off:
    they were ignored without a word (the relay logs them at start)."""
    if settings.exactly_once:
        return []
    return [option.flag for option in OPTIONS
            if option.name.startswith("exactly_once_")
            and getattr(settings, option.name) != getattr(Settings, option.name)]


def mark_connections(settings: Settings) -> int:
    """The mark connections the relay opens: ``--mark-connections``, or by default
    :data:`DEFAULT_MARK_CONNECTIONS` (:data:`DEFAULT_EXACTLY_ONCE_MARK_CONNECTIONS` in
    exactly-once mode)."""
    if settings.mark_connections:
        return settings.mark_connections
    return DEFAULT_EXACTLY_ONCE_MARK_CONNECTIONS if settings.exactly_once else DEFAULT_MARK_CONNECTIONS


def producer_config(settings: Settings) -> dict[str, str]:
    """librdkafka configuration: defaults, then the user's properties, then the guarantees."""
    config = dict(DEFAULT_PRODUCER)
    if not settings.claim_interval_s:
        config["linger.ms"] = UNPACED_LINGER_MS
    config.update(settings.kafka_properties)
    for name, value in REQUIRED_PRODUCER.items():
        for given_name in (name, *(c for c, alias in KAFKA_ALIASES.items() if alias == name)):
            given = config.pop(given_name, None)
            if given is not None and given.strip().lower() not in _REQUIRED_EQUIVALENTS[name]:
                raise ConfigError(
                    f"kafka property {given_name}={given!r} would break the relay's delivery "
                    f"guarantee; it must be {value}"
                )
        config[name] = value
    if "transactional.id" in config:  # the producer would refuse to produce outside a transaction
        raise ConfigError("kafka property transactional.id: the relay's producer is not transactional; "
                          "exactly-once mode (--exactly-once true) names each shard's producer "
                          "from --exactly-once-transactional-id-prefix")
    config["bootstrap.servers"] = settings.bootstrap_servers
    check_kafka_files(config)
    check_oauthbearer(config)
    return config


def check_oauthbearer(config: Mapping[str, str]) -> None:
    """SASL OAUTHBEARER needs a token source the relay can use (a sidecar configured by its
    environment can give no token callback): outbox_core.text.lacks_token_source."""
    if lacks_token_source(config):
        raise ConfigError("kafka property sasl.mechanism=OAUTHBEARER needs a token source: set "
                          "sasl.oauthbearer.method=oidc (with sasl.oauthbearer.client.id, "
                          "sasl.oauthbearer.client.secret and sasl.oauthbearer.token.endpoint.url), or "
                          "enable.sasl.oauthbearer.unsecure.jwt=true for a test cluster")


#: librdkafka properties that name a file (or, for ssl.ca.location, a directory).
KAFKA_FILE_PROPERTIES = ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location",
                         "ssl.keystore.location", "ssl.crl.location", "sasl.kerberos.keytab")


def check_kafka_files(config: Mapping[str, str]) -> None:
    """A path that is not there or cannot be read, named with its property: OpenSSL said
    "ssl.ca.location failed: ... BIO lib" or "system lib" for both."""
    for name in KAFKA_FILE_PROPERTIES:
        path = config.get(name)
        if not path or (name == "ssl.ca.location" and path == "probe"):
            continue
        where = f"kafka property {name}: {path!r}"
        if not os.path.exists(path):
            raise ConfigError(f"{where} does not exist")
        if name != "ssl.ca.location" and not os.path.isfile(path):  # OpenSSL: "PEM lib"
            raise ConfigError(f"{where} is not a file")
        if not os.access(path, os.R_OK):
            raise ConfigError(f"{where} cannot be read by this process (uid {os.getuid()})")


def max_message_bytes(config: Mapping[str, str]) -> int:
    """The producer's ``message.max.bytes`` (librdkafka's default when not set)."""
    try:
        return int(config.get("message.max.bytes", "1000000"))
    except ValueError:
        raise ConfigError(f"kafka property message.max.bytes={config['message.max.bytes']!r} "
                          "is not a number") from None


