"""librdkafka's own check of the consumer's properties, run when the configuration is made.

librdkafka checks property names and values only when a client is made, and the consumer
made its client in ``start()``: a misspelled property raised there, at run time, perhaps on
another thread.  :func:`check_consumer_properties` makes a consumer of the same properties
and destroys it at once, raising what ``start()`` raises (a :class:`ConfigError`, "invalid
Kafka consumer configuration: ..." naming the property).  That client reaches nothing and
costs about a millisecond (a few more with TLS, whose files it reads):

* no ``bootstrap.servers``: librdkafka connects to a bootstrap broker as soon as a client
  is made (:class:`~consumer_sdk.config.InboxConfig` checks the list's form itself);
* no credential asked for: an ``oauth_cb`` is called and waited for, an OIDC token endpoint
  asked and GSSAPI's ``kinit`` run when a SASL client is made, so with those mechanisms the
  check's client is not a SASL one (the mechanism's own properties are still checked; what
  only a SASL client checks, such as whether the mechanism is built in, is checked at start).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException

from consumer_sdk.errors import ConfigError
from outbox_core.kafka_errors import refusal_text

#: The check client's own lines (a warning that the protocol is not SASL, the warnings the
#: consumer's client repeats at start) go nowhere: no handler, not passed on.
_SILENT = logging.getLogger("consumer_sdk.librdkafka.check")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False
#: SASL mechanisms whose credentials librdkafka (or confluent-kafka) fetches when a client is made.
_ASKS_AT_CREATION = ("OAUTHBEARER", "GSSAPI")
_WITHOUT_SASL = {"sasl_plaintext": "plaintext", "sasl_ssl": "ssl"}


def check_consumer_properties(config: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` when librdkafka refuses ``config`` (a consumer's), as
    :func:`consumer_sdk.kafka.build_consumer` does; secret values are masked."""
    try:
        Consumer({**offline(config), "logger": _SILENT}).close()
    except (KafkaException, TypeError, ValueError) as exc:
        raise ConfigError(f"invalid Kafka consumer configuration: {refusal_text(exc, config)}") from None


def offline(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` for a client that contacts nothing (see the module docstring).  A callable
    ``oauth_cb`` is left out; anything else given for it is kept, for confluent-kafka to refuse."""
    props = {k: v for k, v in config.items()
             if k != "bootstrap.servers" and not (k == "oauth_cb" and callable(v))}
    protocol = str(props.get("security.protocol", "plaintext")).strip().lower()
    mechanism = str(props.get("sasl.mechanism", props.get("sasl.mechanisms", "GSSAPI"))).strip().upper()
    if protocol in _WITHOUT_SASL and mechanism in _ASKS_AT_CREATION:
        props["security.protocol"] = _WITHOUT_SASL[protocol]
    return props
