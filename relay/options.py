"""The option table: every setting's flag, environment variable, parser, default and help.

:data:`OPTIONS` is the single source of the flags, of the ``OUTBOX_RELAY_<NAME>`` variables
and of ``--help``; each option's value parser (the bounds no real setting comes near) lives
here with it.  relay/config.py turns the values into :class:`relay.config.Settings`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from outbox_core.text import valid_topic_name

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
#: Topics with a series of their own in the metrics labelled by topic (relay/metric_labels.py):
#: generous for a relay's usual few topics, a bound all the same when rows name a topic per
#: tenant or a writer's bug mints one per row (each label value is a series for the
#: process's life, in every Prometheus that scrapes it).
DEFAULT_METRICS_MAX_TOPICS = 100
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
#: migrate: the longest the claim's index, built CONCURRENTLY on a large outbox (writers go on),
#: waits in all for older transactions (under the migration Job's 600 s deadline, deploy/k8s).
DEFAULT_INDEX_WAIT_S = 300.0
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


def _topic_count(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_INT:
        raise ValueError(f"must be a number of topics from 0 to {MAX_INT}")
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
    Option(name="metrics_max_topics", parse=_topic_count, default=DEFAULT_METRICS_MAX_TOPICS,
           help="topics with series of their own in the metrics labelled by topic, the first "
                "seen; rows of later topics are counted under topic=\"_other\" (a topic per "
                "tenant or per row cannot flood Prometheus); 0: all under _other"),
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
    Option(name="index_wait_s", parse=_positive_float, default=DEFAULT_INDEX_WAIT_S,
           help="migrate: how long the claim's index, built CONCURRENTLY on a large outbox while "
                "writers go on, waits in all for older transactions to end before it gives up",
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
