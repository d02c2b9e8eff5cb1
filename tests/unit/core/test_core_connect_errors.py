"""outbox_core.connect_errors: one classification of failed connection attempts, and each
caller's explicit reading of it (the relay's and the SDK's error types, the relay's exit codes)."""

from __future__ import annotations

import psycopg
import pytest

from consumer_sdk import _pg
from consumer_sdk import errors as sdk_errors
from outbox_core.connect_errors import ConnectFailure, classify_connect_error
from relay import errors as relay_errors
from relay import store as relay_store

AT = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
SAID = [
    ("FATAL:  the database system is starting up", ConnectFailure.UNREACHABLE),
    ("FATAL:  the database system is shutting down", ConnectFailure.UNREACHABLE),
    ("FATAL:  sorry, too many clients already", ConnectFailure.UNREACHABLE),
    ("FATAL:  terminating connection due to administrator command", ConnectFailure.UNREACHABLE),
    ("Connection refused\n\tIs the server running on that host?", ConnectFailure.UNREACHABLE),
    ("timeout expired", ConnectFailure.UNREACHABLE),
    ('FATAL:  password authentication failed for user "svc"', ConnectFailure.CREDENTIALS),
    ('FATAL:  no pg_hba.conf entry for host "10.0.0.1", user "svc", database "app"', ConnectFailure.CREDENTIALS),
    ('FATAL:  role "svc" does not exist', ConnectFailure.CREDENTIALS),
    ("fe_sendauth: no password supplied", ConnectFailure.CREDENTIALS),
    ('FATAL:  database "nope" does not exist', ConnectFailure.REFUSED),
    # A TLS set-up that cannot work is refused, not waited for; a connection lost mid-way is.
    ("server does not support SSL, but SSL was required", ConnectFailure.REFUSED),
    ("SSL error: certificate verify failed", ConnectFailure.REFUSED),
    ('root certificate file "/etc/ssl/pg/root.crt" does not exist\nEither provide the file, '
     "use the system's trusted roots with sslrootcert=system, or change sslmode to disable "
     "server certificate verification.", ConnectFailure.REFUSED),
    ('server certificate for "db.internal" does not match host name "10.0.0.5"', ConnectFailure.REFUSED),
    ("SSL error: tlsv1 alert unknown ca", ConnectFailure.REFUSED),
    ('certificate present, but not private key file "/app/client.key"', ConnectFailure.REFUSED),
    # An option's value libpq refuses only when it connects is the DSN's fault.
    ('connection is bad: invalid target_session_attrs value: "bogus"', ConnectFailure.INVALID_DSN),
    ('invalid integer value "abc" for connection option "keepalives"', ConnectFailure.INVALID_DSN),
    ('could not parse network address "notanip": Name or service not known', ConnectFailure.INVALID_DSN),
    ("could not match 3 port numbers to 2 hosts", ConnectFailure.INVALID_DSN),
    # A service no pg_service.conf defines was an outage (an audit of the relay's command line).
    ('connection is bad: definition of service "nosuch" not found', ConnectFailure.INVALID_DSN),
    ('service file "/etc/pg_service.conf" not found', ConnectFailure.INVALID_DSN),
    ("SSL SYSCALL error: EOF detected", ConnectFailure.UNREACHABLE),
    ("SSL connection has been closed unexpectedly", ConnectFailure.UNREACHABLE),
]
# Each caller's reading, written out: only an unreachable database is waited for.
RELAY = {ConnectFailure.UNREACHABLE: relay_errors.DatabaseUnavailable,
         ConnectFailure.CREDENTIALS: relay_errors.AuthenticationFailed,
         ConnectFailure.REFUSED: relay_errors.FatalError,
         ConnectFailure.INVALID_DSN: relay_errors.ConfigError}
SDK = {ConnectFailure.UNREACHABLE: sdk_errors.DatabaseUnavailable,
       ConnectFailure.CREDENTIALS: sdk_errors.AuthenticationFailed,
       ConnectFailure.REFUSED: sdk_errors.FatalError,
       ConnectFailure.INVALID_DSN: sdk_errors.ConfigError}


@pytest.mark.parametrize(("said", "kind"), SAID)
def test_what_the_server_said_decides_the_kind(said: str, kind: ConnectFailure) -> None:
    failed = classify_connect_error(psycopg.OperationalError(AT + said))
    assert failed.kind is kind
    assert failed.retriable is (kind is ConnectFailure.UNREACHABLE)
    assert "\n" not in failed.message


@pytest.mark.parametrize(("said", "kind"), SAID)
def test_the_relay_waits_only_for_an_unreachable_database_and_exits_4_on_credentials(
        said: str, kind: ConnectFailure) -> None:
    error = relay_store.translate_connect_error(psycopg.OperationalError(AT + said))
    assert type(error) is RELAY[kind]
    assert isinstance(error, relay_errors.RetriableError) is (kind is ConnectFailure.UNREACHABLE)
    if kind is ConnectFailure.CREDENTIALS:
        assert isinstance(error, relay_errors.FatalError) and error.exit_code == 4


@pytest.mark.parametrize(("said", "kind"), SAID)
def test_the_sdk_retries_only_an_unreachable_database_and_raises_credentials_as_fatal(
        said: str, kind: ConnectFailure) -> None:
    error = _pg.translate_connect_error(psycopg.OperationalError(AT + said))
    assert type(error) is SDK[kind]
    assert isinstance(error, sdk_errors.RetriableError) is (kind is ConnectFailure.UNREACHABLE)
    assert isinstance(error, sdk_errors.FatalError) is (kind in (ConnectFailure.CREDENTIALS, ConnectFailure.REFUSED))


def test_an_unparsable_dsn_is_a_configuration_error_for_both_without_its_password() -> None:
    dsn = "host=db password='s3cret user=x"
    with pytest.raises(psycopg.ProgrammingError) as raised:
        psycopg.conninfo.conninfo_to_dict(dsn)
    failed = classify_connect_error(raised.value, dsn=dsn)
    assert failed.kind is ConnectFailure.INVALID_DSN
    for error in (relay_store.translate_connect_error(raised.value, dsn),
                  _pg.translate_connect_error(raised.value, dsn)):
        assert isinstance(error, relay_errors.ConfigError | sdk_errors.ConfigError)
        assert "s3cret" not in str(error)


def test_messages_show_no_piece_of_the_password() -> None:
    dsn = "postgresql://svc:hunter2@127.0.0.1/app"
    exc = psycopg.OperationalError(AT + 'FATAL:  password authentication failed for user "svc" (hunter2)')
    assert "hunter2" not in classify_connect_error(exc, dsn=dsn).message
    assert "hunter2" not in str(relay_store.translate_connect_error(exc, dsn))
    assert "hunter2" not in str(_pg.translate_connect_error(exc, dsn))


@pytest.mark.parametrize("dsn", [
    'postgresql://:"§%@db/app',  # found by the SDK's property test (2026-12-02)
    'postgresql://:"§%@db/app?application_name=a@b',
    "postgresql://u:pa%zzss@db/app",
])
def test_a_bad_percent_escape_in_the_password_is_not_quoted_back(dsn: str) -> None:
    """libpq quotes the token from a bad %-escape on; it is a piece of the password."""
    with pytest.raises(psycopg.ProgrammingError) as info:
        psycopg.conninfo.conninfo_to_dict(dsn)
    failed = classify_connect_error(info.value, dsn=dsn)
    assert failed.kind is ConnectFailure.INVALID_DSN
    password = dsn.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    for piece in (password[i:i + 2] for i in range(len(password) - 1)):
        assert piece not in failed.message, failed.message
