"""What a Kafka client's error says about its set-up, decided once for the relay and the SDK.

librdkafka retries everything on its own, a password the cluster rejected and a TLS set-up
that cannot work included: a client reading every error as "the cluster is down" waits for
ever.  :func:`setup_failure` picks out the errors no retry can fix and words them for a
person; each caller maps them onto its own way of stopping (the relay's ``FatalError``,
exit 1; the SDK's ``KafkaFatal`` out of ``run()``).

The rule for TLS set-ups librdkafka reports as a transport error (TLS against a plaintext
listener, a listener that requires a client certificate the client has not): they are the
configuration's fault only while no broker has answered this client yet; later, the same
words may come from a broker restarting mid-handshake.  Each caller keeps its own
"answered" flag.
"""

from __future__ import annotations

import re

from confluent_kafka import KafkaError

CREDENTIALS_REJECTED = "the Kafka cluster rejected the credentials (SASL)"
TLS_FAILED = "the TLS handshake with the Kafka cluster failed"

#: Client errors that mean the credentials or the TLS set-up are wrong, whenever they come.
SETUP_CODES: dict[int, str] = {
    KafkaError._AUTHENTICATION: CREDENTIALS_REJECTED,
    KafkaError._SSL: TLS_FAILED,
    KafkaError.SASL_AUTHENTICATION_FAILED: CREDENTIALS_REJECTED,
}

#: librdkafka's words, in a transport error, for a TLS set-up that cannot work: TLS against
#: a plaintext listener, or a listener that requires a client certificate the client has
#: not.  Until an audit of the security paths the relay and the SDK waited for them for
#: ever, as for a broker that is down.
TLS_SETUP_FAILED = re.compile(r"connecting to a PLAINTEXT broker listener\?|alert certificate required")


def setup_failure(code: int, text: str, *, answered: bool) -> str | None:
    """The one line saying why a client with this error can never work, or None when the
    error may pass (a broker down, a leader moving).  ``text`` is librdkafka's, masked;
    ``answered``: some broker has answered this client already."""
    if code in SETUP_CODES:
        return f"{SETUP_CODES[code]}: {text}"
    if code == KafkaError._TRANSPORT and not answered and TLS_SETUP_FAILED.search(text):
        return f"{TLS_FAILED}: {text}"
    return None
