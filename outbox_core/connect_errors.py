"""What a failed PostgreSQL connection attempt means, decided once for the relay and the SDK.

libpq gives no SQLSTATE for connection failures, so the classification reads the
server's ``FATAL`` message (and libpq's own text) here, at one seam:

========================  =====================================================  ===========
:class:`ConnectFailure`   what was said                                          retry?
========================  =====================================================  ===========
``INVALID_DSN``           libpq could not parse the connection string, or one    no
                          of its options' values (``target_session_attrs``,
                          ``keepalives``, hosts against ports, ...)
``CREDENTIALS``           password or pg_hba rejection, missing role,             no
                          no password supplied
``REFUSED``               any other ``FATAL`` (no such database, ...); a TLS      no
                          set-up that cannot work (server without SSL, a
                          certificate not trusted or not found, a host name
                          the certificate does not name)
``UNREACHABLE``           no answer, starting up, shutting down, in recovery,     yes
                          too many clients, terminated: everything else
========================  =====================================================  ===========

Each caller maps the kind onto its own exception types, explicitly (``relay/store.py``,
``consumer_sdk/_pg.py``).  Both treat rejected credentials as fatal: a DSN is read once
at start, so the next attempt would send the same password; the relay exits with code 4,
the SDK raises its ``AuthenticationFailed`` to the service that embeds it.  Messages carry
no piece of the DSN's password (:func:`outbox_core.secrets.scrub`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox_core.secrets import scrub

__all__ = ["ConnectFailure", "FailedConnect", "classify_connect_error", "connect_timeout", "unset_options"]


class ConnectFailure(StrEnum):
    INVALID_DSN = "invalid_dsn"
    CREDENTIALS = "credentials"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"


_PREFIX = {
    ConnectFailure.INVALID_DSN: "invalid PostgreSQL connection string",
    ConnectFailure.CREDENTIALS: "the database rejected the credentials",
    ConnectFailure.REFUSED: "the database refused the connection",
    ConnectFailure.UNREACHABLE: "database unreachable",
}

# Connection-time refusals that are still worth waiting for.
_TRANSIENT_FATAL = re.compile(
    r"starting up|shutting down|in recovery|recovery mode|not yet accepting connections|"
    r"too many (connections|clients)|remaining connection slots|"
    r"terminating connection|administrator command|cannot connect now", re.IGNORECASE)
_CREDENTIALS = re.compile(r"password authentication failed|authentication failed|no pg_hba.conf entry|"
                          r"password is required|role \".*\" does not exist", re.IGNORECASE)
# libpq's own words when the server asks for a password the DSN does not hold (no FATAL).
_NO_PASSWORD = re.compile(r"fe_sendauth: no password supplied", re.IGNORECASE)
# libpq's words for an option value it refuses when it connects, not when it parses the
# string: retried, a typo such as target_session_attrs=bogus kept a relay waiting for ever.
_BAD_OPTION = re.compile(
    r"invalid [\w ]+ value|invalid integer value .* for connection option|"
    r"could not parse network address|could not match \d+ (port numbers|host names|hostaddr values)|"
    # service=name that no pg_service.conf defines: "database unreachable", retried for ever.
    r"definition of service \".*\" not found|service file \".*\" not found",
    re.IGNORECASE)
_LIBPQ_WRAPPING = re.compile(r'^(connection is bad:\s*)?(connection to server (at|on) .*? failed:\s*)?')
# libpq's and OpenSSL's words for a TLS set-up that fails the same way every time (no FATAL):
# retried, they kept a relay waiting for a database it would never reach, as "unreachable".
# A connection lost mid-handshake ("SSL SYSCALL error", "closed unexpectedly") stays retried.
_TLS_SETUP = re.compile(
    r"does not support SSL|certificate verify failed|root certificate file|"
    r"could not (open|read|load) (certificate|private key)|certificate present, but not private key|"
    r"private key file .* has (group or world|world) access|does not match host name|"
    r"alert (unknown ca|bad certificate|certificate required|handshake failure|protocol version)|"
    r"unsupported protocol|no protocols available|wrong version number", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class FailedConnect:
    """A classified connection failure: its ``kind`` and a one-line, masked ``message``."""

    kind: ConnectFailure
    detail: str

    @property
    def retriable(self) -> bool:
        return self.kind is ConnectFailure.UNREACHABLE

    @property
    def message(self) -> str:
        return f"{_PREFIX[self.kind]}: {self.detail}"


def classify_connect_error(exc: BaseException, *, dsn: str = "") -> FailedConnect:
    """Classify ``exc``, raised by ``psycopg.connect(dsn, ...)``; see the module's table."""
    text = str(exc).strip()

    def masked(line: str) -> str:
        return scrub(line, dsn=dsn)

    if isinstance(exc, psycopg.ProgrammingError):  # libpq could not parse the DSN
        # Masked whole, then cut: a quoted token libpq choked on may run past the first line.
        return FailedConnect(ConnectFailure.INVALID_DSN, (masked(text).splitlines() or [""])[0])
    if "FATAL:" in text and not _TRANSIENT_FATAL.search(text):
        detail = text.split("FATAL:", 1)[1].strip().splitlines()[0]
        kind = ConnectFailure.CREDENTIALS if _CREDENTIALS.search(detail) else ConnectFailure.REFUSED
        return FailedConnect(kind, masked(detail))
    first = text.splitlines()[0] if text else type(exc).__name__
    if _NO_PASSWORD.search(text):
        return FailedConnect(ConnectFailure.CREDENTIALS, masked(first))
    if _BAD_OPTION.search(text):
        # libpq's wrapping ("connection is bad: connection to server at ..., port 1 failed:")
        # says nothing about the value it refused: the detail starts at what it refused.
        return FailedConnect(ConnectFailure.INVALID_DSN, masked(_LIBPQ_WRAPPING.sub("", first)))
    if _TLS_SETUP.search(text):
        return FailedConnect(ConnectFailure.REFUSED, masked(first))
    return FailedConnect(ConnectFailure.UNREACHABLE, masked(first))


def connect_timeout(dsn: str, default_s: int) -> dict[str, Any]:
    """The ``connect_timeout`` argument for ``psycopg.connect(dsn, ...)``: ``default_s``,
    unless the DSN or ``PGCONNECT_TIMEOUT`` sets one (then nothing, and libpq reads theirs).

    An argument outranks the DSN's own value, so one given always replaced a DBA's
    ``connect_timeout=15`` for a distant server with the caller's default, silently.  A
    DSN libpq cannot parse gets the default: connecting then says what is wrong with it."""
    return unset_options(dsn, {"connect_timeout": default_s})


def unset_options(dsn: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The ``defaults`` (libpq options, ``{"keepalives_idle": 10, ...}``) that neither the DSN
    nor the option's libpq environment variable (``PGCONNECT_TIMEOUT``...) sets: arguments
    for ``psycopg.connect(dsn, ...)`` (or ``make_conninfo``) that never replace a value the
    DSN's author chose (see :func:`connect_timeout`).  A DSN libpq cannot parse gets them all."""
    unset = {key: value for key, value in defaults.items()
             if not os.environ.get(_env_names().get(key, ""), "").strip()}
    try:
        given = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return unset
    return {key: value for key, value in unset.items() if not str(given.get(key, "")).strip()}


@functools.cache
def _env_names() -> dict[str, str]:
    """libpq's environment variable of each option that has one (``connect_timeout``:
    ``PGCONNECT_TIMEOUT``; the keepalives have none)."""
    return {o.keyword.decode(): o.envvar.decode() for o in psycopg.pq.Conninfo.get_defaults() if o.envvar}
