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

A plaintext client against a TLS listener gets no word from librdkafka but "1/1 brokers are
down": :class:`TlsListenerProbe` asks the bootstrap addresses for a TLS handshake itself.
"""

from __future__ import annotations

import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from outbox_core.secrets import scrub

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


#: The protocol to suggest when the listener answers TLS and the client does not speak it.
_WITH_TLS = {"plaintext": "SSL", "sasl_plaintext": "SASL_SSL"}
PROBE_TIMEOUT_S = 1.0  # one TLS handshake with a bootstrap address
PROBE_EVERY_S = 10.0  # at most one probe this often per client
PROBE_ADDRESSES = 3  # bootstrap addresses probed at most
PROBE_WAIT_S = 1.5  # how long the caller waits for a probe (TlsListenerProbe)


def bootstrap_addresses(servers: str) -> list[tuple[str, int]]:
    """(host, port) of each entry of a bootstrap.servers list (``[v6]:port`` included; port
    9092 when none is given); entries that are not host:port are left out."""
    found = []
    for entry in (e.strip() for e in servers.split(",")):
        entry = entry.split("://", 1)[-1]
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = entry.rpartition(":") if ":" in entry else (entry, "", "")
        port = port or "9092"
        if host and port.isdigit() and 0 < int(port) < 65536:
            found.append((host, int(port)))
    return found


def answers_tls(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when the listener at host:port completes a TLS handshake, or answers with a TLS
    alert (one that wants a client certificate); the certificate is not checked: only the
    protocol is asked about.  A plaintext Kafka listener closes the connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock, \
                context.wrap_socket(sock, server_hostname=host):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or "").upper()
    except (OSError, ValueError):
        return False


class TlsListenerProbe:
    """A plaintext client (PLAINTEXT, SASL_PLAINTEXT) against a TLS listener: librdkafka says
    only "1/1 brokers are down", as for a cluster that is down (the listener closes the
    connection at the client's first request, which is not TLS; so does a proxy without a
    backend, so that alone proves nothing).  When every broker is down and none has answered
    yet, :meth:`failure` asks the bootstrap addresses for a TLS handshake itself: one that
    completes proves the set-up wrong.  At most one probe every ``PROBE_EVERY_S``.

    The probe runs on a thread of its own and the caller (the relay's loop, the consumer's
    poll) waits for it at most ``PROBE_WAIT_S``: a host name's resolution is not bounded by
    the socket's timeout, and during a DNS outage it took the caller's thread for as long as
    the resolver retried.  A probe not done by then is reported at a later call."""

    def __init__(self, properties: Mapping[str, Any], *,
                 probe: Callable[[str, int], bool] | None = None) -> None:
        """``probe(host, port)``: whether a listener answers TLS (:func:`answers_tls`)."""
        protocol = str(properties.get("security.protocol", "plaintext")).strip().lower()
        self._suggest = _WITH_TLS.get(protocol)
        self._protocol = protocol.upper()
        self._addresses = bootstrap_addresses(str(properties.get("bootstrap.servers", "")))[:PROBE_ADDRESSES]
        self._probe = probe
        self._next = 0.0
        self._running: threading.Thread | None = None
        self._found: tuple[str, int] | None = None

    def failure(self, code: int, text: str, *, answered: bool) -> str | None:
        """The one line saying the listener expects TLS, or None (not proved, or not asked)."""
        if code != KafkaError._ALL_BROKERS_DOWN or answered or self._suggest is None:
            return None
        now = time.monotonic()
        if self._found is None and now >= self._next and not (self._running and self._running.is_alive()):
            self._next = now + PROBE_EVERY_S
            self._running = threading.Thread(target=self._look, daemon=True, name="kafka-tls-probe")
            self._running.start()
        if self._running is not None:
            self._running.join(PROBE_WAIT_S)
        if self._found is None:
            return None
        host, port = self._found
        return (f"the Kafka listener at {host}:{port} expects TLS, and security.protocol is "
                f"{self._protocol}: set it to {self._suggest} (librdkafka said: {text})")

    def _look(self) -> None:
        probe = self._probe or answers_tls
        for host, port in self._addresses:
            if probe(host, port):
                self._found = (host, port)
                return


#: OpenSSL's "PEM lib", all librdkafka says when it cannot read the client's key (a wrong
#: ssl.key.password, none for an encrypted key, a file that is not a PEM key) or certificate.
_KEY_UNREADABLE = re.compile(r"ssl\.key\.(location|pem) failed:.*PEM lib")
_CERTIFICATE_UNREADABLE = re.compile(r"ssl\.certificate\.(location|pem) failed:.*PEM lib")


def with_file_hint(text: str) -> str:
    """``text`` (librdkafka's refusal of a configuration) with what to check when it says only
    that the client's key or certificate could not be read."""
    if _KEY_UNREADABLE.search(text):
        return f"{text}: the client key could not be read: wrong ssl.key.password, or the key file is not PEM"
    if _CERTIFICATE_UNREADABLE.search(text):
        return f"{text}: the client certificate could not be read: the file is not a PEM certificate"
    return text


def refusal_text(exc: BaseException, properties: Mapping[str, Any]) -> str:
    """What a client's constructor raised, as one masked line with :func:`with_file_hint`'s hint
    (a KafkaException shows librdkafka's text, not the KafkaError's repr)."""
    cause = exc.args[0] if exc.args else None
    text = cause.str() if isinstance(exc, KafkaException) and isinstance(cause, KafkaError) else str(exc)
    return with_file_hint(" ".join(scrub(text, properties=properties).split()))
