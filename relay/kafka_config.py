"""librdkafka's configuration of the relay's producer: defaults, the user's properties, the guarantees.

:func:`producer_config` builds it from the settings and refuses what would break the relay's
delivery guarantee; the files and the token source it names are checked before the client
is made.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from outbox_core.text import lacks_token_source
from relay.errors import ConfigError

if TYPE_CHECKING:
    from relay.config import Settings

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


