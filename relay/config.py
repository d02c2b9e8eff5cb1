"""Settings: one frozen, keyword-only object, validated once at start.

Every option is a flag and an environment variable ``OUTBOX_RELAY_<NAME>``;
the table :data:`OPTIONS` is the single source of both, and of ``--help``.
librdkafka properties pass through as ``OUTBOX_RELAY_KAFKA_<PROPERTY>``
(``OUTBOX_RELAY_KAFKA_SECURITY_PROTOCOL`` becomes ``security.protocol``) or as
repeated ``--kafka-property NAME=VALUE`` flags.  A secret can be read from a
file named by ``<VARIABLE>_FILE``, as Kubernetes mounts secrets.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox_core.secrets import InvalidDsn

# One masking for the relay and the SDK: the four imported "as" themselves are re-exported
# (relay code imports them from here); validate_dsn is this module's (valid_topic_name relay/options.py's).
from outbox_core.secrets import is_secret as is_secret
from outbox_core.secrets import mask_dsn as mask_dsn
from outbox_core.secrets import mask_text as mask_text
from outbox_core.secrets import masked_properties as masked_properties
from outbox_core.secrets import validate_dsn as _validate_dsn
from outbox_core.text import bootstrap_servers_problem

# The option table, the env mapping and the producer's configuration live in their own
# modules (relay/options.py, relay/config_env.py, relay/kafka_config.py); the names other
# packages and the tests import from here are re-exported.
from relay.config_env import env_values as env_values
from relay.config_env import kafka_env_properties as kafka_env_properties
from relay.config_env import parse_kafka_property as parse_kafka_property
from relay.config_env import unknown_env_variables as unknown_env_variables
from relay.errors import ConfigError
from relay.kafka_config import max_message_bytes as max_message_bytes
from relay.kafka_config import producer_config as producer_config
from relay.options import (
    DEFAULT_BACKLOG_INTERVAL_S,
    DEFAULT_BACKOFF_INITIAL_S,
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_BATCH_MAX_BYTES,
    DEFAULT_BATCH_SIZE,
    DEFAULT_CLAIM_INTERVAL_S,
    DEFAULT_CLEANUP_BATCH,
    DEFAULT_CLEANUP_INTERVAL_S,
    DEFAULT_CONSOLE_HOST,
    DEFAULT_CONSOLE_PORT,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_EXACTLY_ONCE_COMMIT_INTERVAL_S,
    DEFAULT_EXACTLY_ONCE_MARK_CONNECTIONS,
    DEFAULT_EXACTLY_ONCE_PIPELINE_DEPTH,
    DEFAULT_EXACTLY_ONCE_POSITION_TOPIC,
    DEFAULT_EXACTLY_ONCE_TRANSACTIONAL_ID_PREFIX,
    DEFAULT_INDEX_WAIT_S,
    DEFAULT_LEASE_DURATION_S,
    DEFAULT_LOCK_TIMEOUT_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_METRICS_HOST,
    DEFAULT_METRICS_MAX_TOPICS,
    DEFAULT_METRICS_PORT,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_STUCK_AFTER_S,
)
from relay.options import DEFAULT_CLAIM_INTERVAL_MAX_S as DEFAULT_CLAIM_INTERVAL_MAX_S
from relay.options import DEFAULT_MARK_CONNECTIONS as DEFAULT_MARK_CONNECTIONS
from relay.options import DEFAULT_PIPELINE_DEPTH as DEFAULT_PIPELINE_DEPTH
from relay.options import ENV_PREFIX as ENV_PREFIX
from relay.options import KAFKA_ENV_PREFIX as KAFKA_ENV_PREFIX
from relay.options import MAX_INT as MAX_INT
from relay.options import MAX_SECONDS as MAX_SECONDS
from relay.options import OPTIONS as OPTIONS
from relay.options import OPTIONS_BY_NAME as OPTIONS_BY_NAME


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
    metrics_max_topics: int = DEFAULT_METRICS_MAX_TOPICS
    log_format: str = "auto"
    log_level: str = "info"
    owner: str = ""
    table: str = "outbox"
    shards: int | None = None
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    index_wait_s: float = DEFAULT_INDEX_WAIT_S
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

