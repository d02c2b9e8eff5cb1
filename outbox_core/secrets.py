"""Secrets never leave the process: masking for reprs, logs and errors (relay and SDK).

A DSN's password and every librdkafka property whose name marks a secret
(``sasl.password``, ``ssl.key.password``, ``sasl.oauthbearer.config``, ...) are shown
as ``***``.  One copy of the rules: the relay (``relay.config``) and the SDK
(``consumer_sdk.secrets``, which adds its ``ConfigError``) both use this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote

import psycopg.conninfo


class InvalidDsn(ValueError):
    """A DSN libpq cannot parse; the message shows no piece of its password.

    Each caller turns it into its own configuration error."""

SECRET_MARKERS = ("password", "secret", "passphrase", "sasl.oauthbearer.config", "key.pem", "token",
                  "jaas",  # sasl.jaas.config: a Java client's login line, with its password
                  # Misspelt names ("sasl.passwd"): shown in a repr or a log line before librdkafka
                  # refuses them as unknown, their values are hidden too.
                  "passw", "pwd")  # "passw" covers passwd and passwort too
MASK = "***"

_URI_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://")
# In free text a URI ends at white space; \S* backtracks to the token's last "@".
_TEXT_URI_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)(\S*)(@)")
_TEXT_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.?)*'?|\S+)", re.IGNORECASE)
_TEXT_QUERY_PASSWORD = re.compile(r"(password=)[^&\s]*", re.IGNORECASE)
# A whole key=value DSN: a quoted value may be unterminated; an unquoted one runs to
# the next "key=" (libpq would stop at a space, but the rest is still the password's).
_DSN_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.?)*'?|.*?(?=\s+\w+\s*=|\s*$))",
                              re.IGNORECASE | re.DOTALL)
_DSN_QUERY_PASSWORD = re.compile(r"(password=)[^&]*", re.IGNORECASE)
# A URI's query parameter.  libpq decodes a %-escape in its key as in its value, so
# "?pass%77ord=..." gives the password as "?password=..." does: the key is read decoded.
_DSN_QUERY_PARAM = re.compile(r"([?&])([^=&]*)(=)([^&]*)")
_TEXT_QUERY_PARAM = re.compile(r"([?&])([^=&\s]*)(=)([^&\s]*)")
_QUOTED = re.compile(r"""(["'])(.*?)\1""", re.DOTALL)
# libpq's messages about a URI it could not parse quote a token of it (a query parameter,
# a %-escape on, the whole URI), which may hold a password's quotes and line breaks: the
# token runs to the message's last quote and is hidden whole.  Until an audit the
# quoted-fragment rule below cut it at the password's first quote and showed the rest
# ('... URI query parameter: "***"§@db/app"').
_URI_TOKEN = re.compile(r'((?:URI query parameter|percent-encoded value|percent-encoded token|in URI'
                        r'|\(expected ":" or "/"\)|internal parser routine): ")(.*)(")', re.DOTALL)
_URI_SPACES = re.compile(r'(unexpected spaces found in ")(.*)(", use percent-encoded spaces)', re.DOTALL)
# libpq quotes the word it found without "=": in a DSN that does not parse, that word may
# be a password given alone (a secret file holding only it) or its second half after a
# space ("password=abc def"); it is hidden whatever it is.
_MISSING_EQUALS = re.compile(r'(missing "=" after ")(.*?)(" in connection info string)', re.DOTALL)
_LIBPQ_LITERALS = frozenset({"=", "]", ":", "/"})
_BEGINNING_AT = re.compile(r"(\bbeginning at:)[^\n]*")
_CERTIFICATE_NAME = re.compile(r'server certificate for "([^"\n]*)"')
#: libpq's Unix socket: ``<directory>/.s.PGSQL.<port>``, a host directory and a port: no secret.
_SOCKET_FILE = re.compile(r"/[^\x00]*/\.s\.PGSQL\.\d+")


def is_secret(name: str) -> bool:
    """True for a property or option whose value must never be shown."""
    lowered = name.lower()
    return any(marker in lowered for marker in SECRET_MARKERS)


def mask_dsn(dsn: str) -> str:
    """The DSN with its password replaced by ``***`` (URI or key=value form).

    In a URI everything from the first ":" of the user info to the LAST "@" goes,
    so an unencoded "@", "/" or ":" in a password cannot leave a piece of it visible.
    """
    scheme = _URI_SCHEME.match(dsn)
    if scheme is None:
        return _DSN_KV_PASSWORD.sub(rf"\1{MASK}", dsn)
    rest = dsn[scheme.end():]
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    return dsn[: scheme.end()] + _DSN_QUERY_PARAM.sub(_hide_password_param,
                                                      _DSN_QUERY_PASSWORD.sub(rf"\1{MASK}", rest))


def mask_text(text: str) -> str:
    """Masks anything that looks like a DSN password inside free text."""
    masked = _TEXT_URI_PASSWORD.sub(rf"\1{MASK}\3", text)
    masked = _TEXT_KV_PASSWORD.sub(rf"\1{MASK}", masked)
    return _TEXT_QUERY_PARAM.sub(_hide_password_param, _TEXT_QUERY_PASSWORD.sub(rf"\1{MASK}", masked))


def _hide_password_param(match: re.Match[str]) -> str:
    """A query parameter with its value masked when its key, %-decoded, names a password."""
    if "password" not in unquote(match.group(2)).lower():
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}{match.group(3)}{MASK}"


def masked_properties(props: Mapping[str, Any]) -> dict[str, Any]:
    """librdkafka properties with every secret's value replaced by ``***``."""
    return {name: (MASK if is_secret(str(name)) else value) for name, value in props.items()}


def scrub(text: str, *, dsn: str = "", properties: Mapping[str, Any] | None = None) -> str:
    """``text`` (an error message) with the DSN's password, the secret properties' values
    and every quoted fragment the masked DSN does not show replaced by ``***``."""
    for name, value in (properties or {}).items():
        if is_secret(str(name)) and isinstance(value, str) and value:
            for piece in _pieces(value):
                text = text.replace(piece, MASK)
    # librdkafka quotes the rest of a property it could not parse ("Unrecognized
    # sasl.oauthbearer.config beginning at: <the rest of the value>").
    text = _BEGINNING_AT.sub(rf"\1 {MASK}", text)
    if not dsn:
        return mask_text(text)
    for password in _passwords(dsn):
        text = text.replace(password, MASK)
    text = _URI_TOKEN.sub(rf"\1{MASK}\3", text)
    text = _URI_SPACES.sub(rf"\1{MASK}\3", text)
    text = _MISSING_EQUALS.sub(rf"\1{MASK}\3", text)
    visible = mask_dsn(dsn)
    # The names a server's certificate holds, which libpq quotes when none is the host's:
    # hidden, the line did not say what the certificate names (an audit of the security paths).
    certified = set(_CERTIFICATE_NAME.findall(text))

    def hide(match: re.Match[str]) -> str:
        quote, token = match.group(1), match.group(2)
        shown = token in visible or token in _LIBPQ_LITERALS or _SOCKET_FILE.fullmatch(token) is not None \
            or token in certified
        return match.group(0) if shown else f"{quote}{MASK}{quote}"

    return _QUOTED.sub(hide, mask_text(text))


def _pieces(value: str) -> list[str]:
    """A secret property's value, and the parts of it an error may quote alone: its
    words and the values of its ``key=value`` words (sasl.oauthbearer.config's client
    secret), longest first; a piece of fewer than 4 characters is too common to hide."""
    pieces = {value}
    for word in value.split():
        pieces.add(word)
        pieces.add(word.partition("=")[2])
    return sorted((p for p in pieces if len(p) >= 4), key=len, reverse=True)


def _passwords(dsn: str) -> list[str]:
    """The DSN's password as libpq reads it (and percent-encoded), when it parses; and
    as written in a URI's user info, which an error about a DSN that does not parse (a
    password with a bad percent-escape) may quote."""
    found = []
    scheme = _URI_SCHEME.match(dsn)
    if scheme is not None:
        userinfo, at, _ = dsn[scheme.end():].rpartition("@")
        if at and ":" in userinfo:
            found.append(userinfo.split(":", 1)[1])
    try:
        password = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
    except (psycopg.Error, UnicodeError, ValueError):
        password = None
    if isinstance(password, str) and password:
        found += [password, quote(password, safe="")]
    # Longest first: a password that contains another form of itself is replaced whole.
    return sorted({p for p in found if p}, key=len, reverse=True)


#: libpq's sslmode values.
SSLMODES = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})


def validate_dsn(dsn: str, *, option: str = "dsn") -> None:
    """Reject a DSN libpq cannot parse or would refuse only at connect time (a port that is
    not one, an unknown sslmode), with :class:`InvalidDsn` naming ``option`` and showing no
    piece of its password.  The relay's checks at start and the SDK's configurations both
    call it."""
    where = f"{option} is not a valid PostgreSQL connection string"
    if not isinstance(dsn, str):  # "argument of type 'NoneType' is not iterable" said nothing
        raise InvalidDsn(f"{option} must be a PostgreSQL connection string (str), not {type(dsn).__name__}")
    if not dsn.strip():
        raise InvalidDsn(f"{option} is empty: give a PostgreSQL connection string")
    if "\x00" in dsn:
        raise InvalidDsn(f"{where}: it contains a NUL character")
    try:
        parts = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise InvalidDsn(f"{where}: {scrub(str(exc).strip(), dsn=dsn)}".splitlines()[0]) from None
    except UnicodeError:
        raise InvalidDsn(f"{where}: it is not valid UTF-8 text") from None
    port = str(parts.get("port", "5432") or "")
    # An empty item is libpq's default port (host1:5433,host2 gives "5433,").
    bad = [p for p in port.split(",") if p and not (p.isdigit() and 0 < int(p) < 65536)]
    if bad:  # the part, not the list: "1,99999" is not in the DSN's text, and was hidden
        raise InvalidDsn(scrub(f"{where}: port {bad[0]!r} is not a TCP port number", dsn=dsn))
    sslmode = parts.get("sslmode")
    if sslmode is not None and sslmode not in SSLMODES:  # libpq refuses it only as it connects
        raise InvalidDsn(scrub(
            f"{where}: sslmode {sslmode!r} is not one of {', '.join(sorted(SSLMODES))}", dsn=dsn))


def safe_repr(obj: Any, fields: Mapping[str, Any]) -> str:
    """``Class(name=value, ...)`` with ``dsn`` masked and secret properties hidden."""
    shown = []
    for name, value in fields.items():
        if name == "dsn" and isinstance(value, str):
            value = mask_dsn(value)
        elif isinstance(value, Mapping) and name.endswith("properties"):
            value = masked_properties(value)
        elif is_secret(name):
            value = MASK
        shown.append(f"{name}={value!r}")
    return f"{type(obj).__name__}({', '.join(shown)})"
