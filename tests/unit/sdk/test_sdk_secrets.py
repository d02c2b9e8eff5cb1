"""No secret in any repr, log line or error of the SDK: property tests, as for the relay
(tests/unit/test_properties.py), over the same generated DSNs with marked passwords."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from consumer_sdk import ConfigError, InboxConfig
from consumer_sdk._pg import translate_connect_error
from consumer_sdk.errors import AuthenticationFailed
from consumer_sdk.jobs import WorkerConfig
from consumer_sdk.secrets import mask_dsn, scrub
from tests.unit.test_properties import MARK, MARK_ENCODED, PROPERTIES, dsns, marked_passwords

SECRET_PROPERTIES = st.sampled_from(["sasl.password", "ssl.key.password", "sasl.oauthbearer.config",
                                     "ssl.keystore.password", "sasl.oauthbearer.client.secret",
                                     "sasl.jaas.config"])


def assert_hidden(shown: str) -> None:
    assert MARK not in shown and MARK_ENCODED not in shown, shown


def _shown(build: Any) -> str:
    try:
        value = build()
    except ConfigError as exc:
        return str(exc) + repr(exc)
    return repr(value) + str(value)


@PROPERTIES
@given(dsn=dsns(marked_passwords), secret=marked_passwords, prop=SECRET_PROPERTIES)
def test_inbox_config_repr_and_errors_show_no_secret(dsn: tuple[str, str, str], secret: str, prop: str) -> None:
    assert_hidden(_shown(lambda: InboxConfig(name="svc", dsn=dsn[0], bootstrap_servers="127.0.0.1:9092",
                                             topics=["t"], kafka_properties={prop: secret})))


@PROPERTIES
@given(dsn=dsns(marked_passwords))
def test_worker_config_repr_and_errors_show_no_secret(dsn: tuple[str, str, str]) -> None:
    assert_hidden(_shown(lambda: WorkerConfig(dsn=dsn[0])))


@PROPERTIES
@given(dsn=dsns(marked_passwords))
def test_connection_errors_show_no_piece_of_the_password(dsn: tuple[str, str, str]) -> None:
    """libpq's messages for a DSN it cannot parse quote the token it choked on."""
    try:
        psycopg.conninfo.conninfo_to_dict(dsn[0])
    except psycopg.ProgrammingError as exc:
        error = translate_connect_error(exc, dsn[0])
        assert isinstance(error, ConfigError)
        assert_hidden(str(error))
    assert_hidden(mask_dsn(dsn[0]))


@PROPERTIES
@given(secret=marked_passwords)
def test_a_rejected_password_is_fatal_and_not_shown(secret: str) -> None:
    exc = psycopg.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  password '
        'authentication failed for user "svc"')
    error = translate_connect_error(exc, f"postgresql://svc:{secret}@127.0.0.1/app")
    assert isinstance(error, AuthenticationFailed)
    assert_hidden(str(error))


@pytest.mark.parametrize("prop", ["sasl.password", "ssl.key.password"])
def test_a_kafka_configuration_error_shows_no_secret_value(prop: str) -> None:
    secret = f"s3{MARK}cret"
    text = f'Invalid value "{secret}" for configuration property "{prop}"'
    assert_hidden(scrub(text, properties={prop: secret}))


def test_the_consumer_logs_its_config_without_secrets() -> None:
    from consumer_sdk import InboxConsumer

    config = InboxConfig(name="svc", dsn=f"postgresql://svc:pw{MARK}@127.0.0.1:1/app",
                         bootstrap_servers="127.0.0.1:1", topics=["t"],
                         kafka_properties={"sasl.password": f"k{MARK}"})
    with capture_logs() as logs:
        consumer = InboxConsumer(config, lambda conn, message: None)
        consumer.log.info("probe", config=config)
    assert_hidden(repr(logs))


def test_the_sdk_takes_a_multi_host_dsn_with_a_default_port() -> None:
    """"h1:5433,h2" (the second host on libpq's default port) was refused as an invalid DSN."""
    from outbox_core.secrets import InvalidDsn, validate_dsn

    validate_dsn("postgresql://u:s3cret@h1:5433,h2/app")
    with pytest.raises(InvalidDsn, match="port '99999'"):
        validate_dsn("postgresql://u:s3cret@h1:1,h2:99999/app")


@pytest.mark.parametrize("dsn", [
    'postgresql://u:@§?§"§@db/app',  # "missing key/value separator ... URI query parameter"
    'postgresql://:@§?§"§@db/app?x=1',  # "invalid URI query parameter"
    'postgresql://u:@§?§"§@[::1/app',
    'postgresql://db/app?password=§" §',  # "unexpected spaces found in"
    'postgresql://db/app?password=§"?a§%00"§',  # "forbidden value %00 in percent-encoded value"
    'postgresql://db/app?password=§"%zz§',  # "invalid percent-encoded token"
    'postgresql://:@§?§\n"§@db/app',  # a line break in the token too
])
def test_a_quote_in_the_password_does_not_cut_libpqs_quoted_token_short(dsn: str) -> None:
    """libpq quotes the rest of a URI it could not parse; a password holding a quote ended the
    hidden token at that quote and showed the rest of the password (property tests found it:
    'postgresql://:@§?§"§@db/app' gave '... URI query parameter: "***"§@db/app"')."""
    with pytest.raises(psycopg.ProgrammingError) as raised:
        psycopg.conninfo.conninfo_to_dict(dsn)
    shown = str(translate_connect_error(raised.value, dsn))
    assert_hidden(shown)
    assert "***" in shown, shown
