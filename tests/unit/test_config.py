from __future__ import annotations

import re

import pytest

from relay.config import (
    OPTIONS,
    build_settings,
    env_values,
    kafka_env_properties,
    mark_connections,
    mask_dsn,
    mask_text,
    parse_kafka_property,
    producer_config,
    unknown_env_variables,
)
from relay.errors import ConfigError

DSN = "postgresql://relay:s3cret@db:5432/app"


def test_every_option_has_a_flag_and_an_env_var() -> None:
    for option in OPTIONS:
        assert option.flag.startswith("--") and "_" not in option.flag
        assert option.env == "OUTBOX_RELAY_" + option.name.upper()


def test_env_values_read_options_and_secret_files(tmp_path) -> None:
    secret = tmp_path / "dsn"
    secret.write_text(DSN + "\n")
    env = {"OUTBOX_RELAY_DSN_FILE": str(secret), "OUTBOX_RELAY_BATCH_SIZE": "50"}
    values = env_values(env, "run")
    assert values == {"dsn": DSN, "batch_size": "50"}


def test_a_secret_file_beside_its_variable_or_empty_is_refused_not_guessed(tmp_path) -> None:
    """An empty OUTBOX_RELAY_DSN beside its _FILE hid the file ("no database given"), both
    set took the variable in silence, and an empty file read as no DSN at all."""
    secret = tmp_path / "dsn"
    secret.write_text(DSN + "\n")
    assert env_values({"OUTBOX_RELAY_DSN": "", "OUTBOX_RELAY_DSN_FILE": str(secret)}, "run") == {"dsn": DSN}
    with pytest.raises(ConfigError, match="set one of OUTBOX_RELAY_DSN or OUTBOX_RELAY_DSN_FILE"):
        env_values({"OUTBOX_RELAY_DSN": DSN, "OUTBOX_RELAY_DSN_FILE": str(secret)}, "run")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_DSN_FILE: .*empty is empty"):
        env_values({"OUTBOX_RELAY_DSN_FILE": str(empty)}, "run")
    with pytest.raises(ConfigError, match="no database given"):
        build_settings({"dsn": "   ", "bootstrap_servers": "k:9092"})  # not the local socket


@pytest.mark.parametrize("order", ["variable first", "file first"])
def test_a_kafka_secret_file_follows_the_dsns_rules(tmp_path, order: str) -> None:
    """A Kafka property's _FILE beside its variable was taken or not by the environment's
    order, and an empty file was an empty password (found by an audit of the command line)."""
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    pair = [("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", "other"), ("OUTBOX_RELAY_KAFKA_SASL_PASSWORD_FILE", str(pw))]
    env = dict(pair if order == "variable first" else pair[::-1])
    with pytest.raises(ConfigError, match="set one of OUTBOX_RELAY_KAFKA_SASL_PASSWORD or "
                                         "OUTBOX_RELAY_KAFKA_SASL_PASSWORD_FILE, not both"):
        kafka_env_properties(env)
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_KAFKA_SASL_PASSWORD_FILE: .*empty is empty"):
        kafka_env_properties({"OUTBOX_RELAY_KAFKA_SASL_PASSWORD_FILE": str(empty)})
    assert kafka_env_properties({"OUTBOX_RELAY_KAFKA_SASL_PASSWORD": "",
                                 "OUTBOX_RELAY_KAFKA_SASL_PASSWORD_FILE": str(pw)}) == {"sasl.password": "s3cret"}


def test_a_kafka_variable_without_a_property_is_named() -> None:
    for name in ("OUTBOX_RELAY_KAFKA_", "OUTBOX_RELAY_KAFKA__FILE"):
        with pytest.raises(ConfigError, match=f"{name} names no Kafka property"):
            kafka_env_properties({name: "x"})


def test_kafka_properties_pass_through_from_env(tmp_path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("hunter2")
    env = {
        "OUTBOX_RELAY_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "OUTBOX_RELAY_KAFKA_SSL_CA_LOCATION": "/ca.pem",
        "OUTBOX_RELAY_KAFKA_SASL_PASSWORD_FILE": str(pw),
        "UNRELATED": "x",
    }
    assert kafka_env_properties(env) == {
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": "/ca.pem",
        "sasl.password": "hunter2",
    }


def test_build_settings_parses_units_and_defaults() -> None:
    s = build_settings({"dsn": DSN, "bootstrap_servers": "k:9092", "poll_interval_s": "0.5",
                        "lease_duration_s": "9"})
    assert s.poll_interval_s == 0.5
    assert s.heartbeat_interval_s == 3.0
    assert s.owner  # host name and pid by default


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"bootstrap_servers": "k:9092"}, "no database given"),
        ({"dsn": DSN}, "no Kafka cluster given"),
        ({"dsn": "host=db port=abc", "bootstrap_servers": "k"}, "not a valid PostgreSQL connection string"),
        ({"dsn": DSN, "bootstrap_servers": "k", "batch_size": "0"}, "--batch-size"),
        ({"dsn": DSN, "bootstrap_servers": "k", "batch_size": "ten"}, "OUTBOX_RELAY_BATCH_SIZE"),
        ({"dsn": DSN, "bootstrap_servers": "k", "poll_interval_s": "-1"}, "--poll-interval-s"),
        ({"dsn": DSN, "bootstrap_servers": "k", "metrics_port": "70000"}, "--metrics-port"),
        ({"dsn": DSN, "bootstrap_servers": "k", "lease_duration_s": "3",
          "heartbeat_interval_s": "5"}, "must be shorter"),
        ({"dsn": DSN, "bootstrap_servers": "k", "claim_interval_s": "-0.1"}, "--claim-interval-s"),
        ({"dsn": DSN, "bootstrap_servers": "k", "keep_published": "maybe"}, "--keep-published"),
        ({"dsn": DSN, "bootstrap_servers": "k", "mark_connections": "9"}, "--mark-connections"),
        ({"dsn": DSN, "bootstrap_servers": "k", "mark_connections": "-1"}, "--mark-connections"),
        # Python's "invalid literal for int() with base 10: '1e3'" was the reason shown
        ({"dsn": DSN, "bootstrap_servers": "k", "cleanup_batch": "1e3"}, "'1e3' is not a whole number"),
        ({"dsn": DSN, "bootstrap_servers": "k", "poll_interval_s": "soon"}, "'soon' is not a number"),
        ({"dsn": DSN, "bootstrap_servers": "k", "keep_published": "false",
          "cleanup_retention_s": "60"}, "nothing for --cleanup-retention-s to keep"),
    ],
)
def test_bad_options_name_the_option(values, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        build_settings(values)
    assert fragment in str(info.value)
    assert "s3cret" not in str(info.value)


def test_malformed_dsn_error_does_not_echo_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        build_settings({"dsn": "postgresql://u:s3cret@h:notaport/db", "bootstrap_servers": "k"})
    assert "s3cret" not in str(info.value)


def test_linger_is_short_only_when_claims_are_not_paced() -> None:
    """A paced claim's rows are flushed (tests/integration/test_linger.py), so linger.ms
    only batches a backlog; with --claim-interval-s 0 nothing flushes a caught-up relay's
    rows, and a longer linger would be their latency."""
    def linger(kafka_properties: dict[str, str] | None = None, **values: str) -> str:
        chosen = build_settings({"dsn": DSN, "bootstrap_servers": "k:9092", **values},
                                kafka_properties=kafka_properties)
        return producer_config(chosen)["linger.ms"]

    assert linger() == "5"
    assert linger(claim_interval_s="0") == "1"
    assert linger({"linger.ms": "20"}, claim_interval_s="0") == "20"


def test_producer_config_keeps_the_delivery_guarantees() -> None:
    s = build_settings({"dsn": DSN, "bootstrap_servers": "k:9092"},
                       kafka_properties={"linger.ms": "20"})
    config = producer_config(s)
    assert config["enable.idempotence"] == "true" and config["acks"] == "all"
    assert config["partitioner"] == "murmur2_random" and config["linger.ms"] == "20"
    weak = build_settings({"dsn": DSN, "bootstrap_servers": "k:9092"}, kafka_properties={"acks": "1"})
    with pytest.raises(ConfigError, match="acks"):
        producer_config(weak)


def test_a_kafka_file_that_is_not_there_is_named_with_its_property(tmp_path) -> None:
    def config(**props: str) -> dict[str, str]:
        return producer_config(build_settings({"dsn": DSN, "bootstrap_servers": "k:9092"},
                                              kafka_properties=props))

    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here: OpenSSL reads it")
    assert config(**{"ssl.ca.location": str(ca)})["ssl.ca.location"] == str(ca)
    assert config(**{"ssl.ca.location": "probe"})["ssl.ca.location"] == "probe"  # the system's store
    assert config(**{"ssl.ca.location": str(tmp_path)})  # a directory of certificates
    for name in ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "sasl.kerberos.keytab"):
        with pytest.raises(ConfigError, match=f"kafka property {name}: '.*/gone.pem' does not exist"):
            config(**{name: str(tmp_path / "gone.pem")})
    for name in ("ssl.certificate.location", "ssl.key.location"):  # OpenSSL said "PEM lib"
        with pytest.raises(ConfigError, match=f"kafka property {name}: .* is not a file"):
            config(**{name: str(tmp_path)})


def test_kafka_property_flag_parsing() -> None:
    assert parse_kafka_property("ssl.ca.location=/x=y") == ("ssl.ca.location", "/x=y")
    with pytest.raises(ConfigError):
        parse_kafka_property("novalue")
    with pytest.raises(ConfigError):
        parse_kafka_property("Bad Name=1")


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://relay:s3cret@db:5432/app",
        "host=db user=relay password=s3cret dbname=app",
        "host=db password='s3 cret' dbname=app",
        "postgresql://db/app?user=relay&password=s3cret",
        # libpq decodes a query key's %-escapes: these name the password too.
        "postgresql://relay@db/app?pass%77ord=s3cret",
        "postgresql://relay@db/app?%70assword=s3cret&sslmode=require",
    ],
)
def test_mask_dsn_hides_passwords(dsn) -> None:
    masked = mask_dsn(dsn)
    assert "s3cret" not in masked and "s3 cret" not in masked
    assert "***" in masked
    in_text = mask_text(f"could not reach {dsn} now")
    assert "s3cret" not in in_text and "***" in in_text


@pytest.mark.parametrize(("option", "value"), [("console_host", ""), ("console_host", " "),
                                               ("metrics_host", ""), ("console_host", "a b")])
def test_an_empty_address_to_listen_on_is_refused(option: str, value: str) -> None:
    # --console-host "" listened on every interface, and the console's Host check (against
    # DNS rebinding) then allowed any name: a request for evil.example was served (200).
    with pytest.raises(ConfigError, match=f"--{option.replace('_', '-')} .* must be a host name or IP address"):
        build_settings({"dsn": DSN, "bootstrap_servers": "k", option: value})
    assert getattr(build_settings({"dsn": DSN, "bootstrap_servers": "k", option: " 0.0.0.0 "}), option) == "0.0.0.0"


@pytest.mark.parametrize("servers", [" ", "127.0.0.1:abc", "127.0.0.1:99999"])
def test_a_bootstrap_list_librdkafka_would_retry_for_ever_is_refused(servers: str) -> None:
    # `run` logged broker_unavailable for ever: "No brokers configured", a connection to
    # port 0, to a port the user never gave (found by an audit of the command line).
    with pytest.raises(ConfigError, match="^--bootstrap-servers / OUTBOX_RELAY_BOOTSTRAP_SERVERS "):
        build_settings({"dsn": DSN, "bootstrap_servers": servers})
    with pytest.raises(ConfigError, match="^--bootstrap-servers"):
        build_settings({"dsn": DSN}, kafka_properties={"bootstrap.servers": servers})


@pytest.mark.parametrize("owner", ["x" * 254, "x" * 9950, "a\nb", " ", "tab\there"])
def test_an_owner_that_is_no_replica_name_is_refused(owner: str) -> None:
    # 9,950 characters overflowed the connection's start-up packet through application_name,
    # and `run` took the refusal for a database outage, retried for ever (an audit's finding).
    with pytest.raises(ConfigError, match="^--owner / OUTBOX_RELAY_OWNER: .* must be 1-253 printable characters"):
        build_settings({"dsn": DSN, "bootstrap_servers": "k", "owner": owner})
    assert build_settings({"dsn": DSN, "bootstrap_servers": "k", "owner": " r-1 "}).owner == "r-1"


def test_a_connection_is_named_within_postgresqls_63_characters_with_its_role() -> None:
    from relay.app import application_name

    assert application_name("r-1", ":mark") == "outbox-relay:r-1:mark"
    long = application_name("x" * 200, ":mark2")
    assert len(long) == 63 and long.startswith("outbox-relay:xxx") and long.endswith(":mark2")


def test_settings_repr_hides_the_dsn_password() -> None:
    s = build_settings({"dsn": DSN, "bootstrap_servers": "k"})
    assert "s3cret" not in repr(s)


@pytest.mark.parametrize(
    ("server_says", "kind"),
    [
        ("FATAL:  the database system is starting up", "DatabaseUnavailable"),
        ("FATAL:  the database system is not yet accepting connections", "DatabaseUnavailable"),
        ("FATAL:  the database system is in recovery mode", "DatabaseUnavailable"),
        ("FATAL:  the database system is shutting down", "DatabaseUnavailable"),
        ("FATAL:  sorry, too many clients already", "DatabaseUnavailable"),
        ("FATAL:  remaining connection slots are reserved for roles with SUPERUSER", "DatabaseUnavailable"),
        ("Connection refused", "DatabaseUnavailable"),
        ("FATAL:  password authentication failed for user \"relay\"", "AuthenticationFailed"),
        ("FATAL:  database \"nope\" does not exist", "FatalError"),
    ],
)
def test_connection_failures_are_classified_by_what_the_server_said(server_says, kind) -> None:
    import psycopg

    from relay.store import translate_connect_error

    error = translate_connect_error(psycopg.OperationalError(
        f'connection to server at "127.0.0.1", port 5432 failed: {server_says}'))
    assert type(error).__name__ == kind


def test_mark_connections_are_one_by_default_and_in_exactly_once_mode_or_as_given() -> None:
    base = {"dsn": DSN, "bootstrap_servers": "k:9092"}
    assert mark_connections(build_settings(base)) == 1
    assert mark_connections(build_settings({**base, "exactly_once": "true"})) == 1
    assert mark_connections(build_settings({**base, "mark_connections": "2"})) == 2
    assert mark_connections(build_settings({**base, "exactly_once": "true", "mark_connections": "3"})) == 3


def test_a_socket_path_in_a_connection_error_is_shown_and_the_password_is_not() -> None:
    """libpq's "connection to server on socket ..." was shown as socket "***": the directory
    a person must check was hidden with the password."""
    from outbox_core.secrets import scrub

    said = 'connection to server on socket "/run/pg/.s.PGSQL.5433" failed: No such file or directory'
    assert scrub(said, dsn="postgresql://u:s3cret@/app?host=/run/pg&port=5433") == said
    assert scrub(said, dsn="host=/run/pg port=5433 password=s3cret") == said
    leaked = 'connection to server on socket "/run/s3cret/.s.PGSQL.5433" failed'
    assert "s3cret" not in scrub(leaked, dsn="host=/run/s3cret password=s3cret")
    assert scrub('could not parse "s3cret-ish"', dsn="password=x") == 'could not parse "***"'
    # The names a server's certificate holds are the server's, not the DSN's: hidden, the line
    # did not say what the certificate names (an audit of the security paths).
    said = ('connection to server at "127.0.0.1", port 5432 failed: server certificate for '
            '"other.example.com" (and 1 other name) does not match host name "127.0.0.1"')
    assert scrub(said, dsn="host=127.0.0.1 sslmode=verify-full password=s3cret") == said


@pytest.mark.parametrize(("values", "props", "fragment"), [
    # read as false, it deleted every row as it was acknowledged
    ({"keep_published": ""}, {}, "--keep-published"),
    ({"keep_published": " "}, {}, "--keep-published"),
    # an idle relay on a full core; a log flooded with heartbeat_late
    ({"poll_interval_s": "1e-300"}, {}, "--poll-interval-s"),
    ({"lease_duration_s": "0.5"}, {}, "--lease-duration-s"),
    ({"claim_interval_s": "5", "claim_interval_max_s": "0.01"}, {}, "--claim-interval-max-s"),
    # the producer then failed every row with 'Erroneous state', for ever
    ({}, {"transactional.id": "x"}, "transactional.id"),
    ({}, {"request.required.acks": "1"}, "request.required.acks='1'"),
    # a broker_unavailable retried for ever; a dead-letter topic Kafka refuses
    ({"exactly_once": "true", "exactly_once_position_topic": ""}, {}, "--exactly-once-position-topic"),
    ({"dead_letter_topic": "bad topic"}, {}, "--dead-letter-topic"),
    # librdkafka waited for an application's token callback: nothing sent, nothing said
    ({}, {"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"}, "needs a token source"),
    ({}, {"sasl.mechanisms": "oauthbearer", "sasl.oauthbearer.method": "default"}, "needs a token source"),
])
def test_settings_that_cannot_work_are_refused(values, props, fragment) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        producer_config(build_settings({"dsn": DSN, "bootstrap_servers": "k:9092", **values},
                                       kafka_properties=props))


def test_oauthbearer_with_a_token_source_is_taken() -> None:
    for props in ({"sasl.mechanism": "OAUTHBEARER", "sasl.oauthbearer.method": "oidc"},
                  {"sasl.mechanism": "OAUTHBEARER", "enable.sasl.oauthbearer.unsecure.jwt": "true"},
                  {"sasl.mechanism": "SCRAM-SHA-512"}):
        assert producer_config(build_settings({"dsn": DSN, "bootstrap_servers": "k:9092"}, kafka_properties=props))


def test_the_guarantees_spelt_as_librdkafka_reads_them_are_taken() -> None:
    """enable.idempotence=1 and acks=-1 were refused as breaking the guarantee they keep."""
    config = producer_config(build_settings({"dsn": DSN, "bootstrap_servers": "k:9092"},
                                            kafka_properties={"enable.idempotence": "1", "acks": "-1"}))
    assert config["enable.idempotence"] == "true" and config["acks"] == "all"


def test_a_multi_host_dsn_is_checked_port_by_port() -> None:
    """An empty item of a port list is libpq's default port, and was refused ("h1:5433,h2"
    is a valid failover DSN); a bad item was named as the whole list, which the scrub then
    hid as '***' (not in the DSN's text)."""
    base = {"bootstrap_servers": "k:9092"}
    assert build_settings({**base, "dsn": "postgresql://u:s3cret@h1:5433,h2/app"})
    with pytest.raises(ConfigError, match="port '99999' is not a TCP port number") as refused:
        build_settings({**base, "dsn": "postgresql://u:s3cret@h1:1,h2:99999/app"})
    assert "s3cret" not in str(refused.value)


def test_exactly_once_options_without_the_mode_are_named() -> None:
    """--exactly-once-* options set while the mode was off were ignored without a word."""
    from relay.config import ignored_options

    base = {"dsn": DSN, "bootstrap_servers": "k:9092"}
    assert ignored_options(build_settings(base)) == []
    set_alone = build_settings({**base, "exactly_once_pipeline_depth": "8", "exactly_once_position_topic": "p"})
    assert ignored_options(set_alone) == ["--exactly-once-position-topic", "--exactly-once-pipeline-depth"]
    assert ignored_options(build_settings({**base, "exactly_once": "true", "exactly_once_pipeline_depth": "8"})) == []


def test_a_misspelt_variable_is_named_with_the_option_it_resembles(capsys: pytest.CaptureFixture[str]) -> None:
    """OUTBOX_RELAY_EXACTLY_ONC=true was ignored in silence, where a misspelt flag is refused
    (an audit of the command line).  Kubernetes' service links for a Service named
    outbox-relay share the prefix and are no mistake."""
    env = {"OUTBOX_RELAY_EXACTLY_ONC": "true", "OUTBOX_RELAY_BATCHSIZE": "abc", "OUTBOX_RELAY_FOO": "1",
           "OUTBOX_RELAY_DSN_FILE": "/x", "OUTBOX_RELAY_KAFKA_ACKS": "all", "OUTBOX_RELAY_PORT": "tcp://10.0.0.1:9464",
           "OUTBOX_RELAY_SERVICE_HOST": "10.0.0.1", "OUTBOX_RELAY_PORT_9464_TCP_ADDR": "10.0.0.1",
           "OUTBOX_RELAY_SERVICE_PORT_METRICS": "9464"}
    assert unknown_env_variables(env) == [("OUTBOX_RELAY_BATCHSIZE", "OUTBOX_RELAY_BATCH_SIZE"),
                                          ("OUTBOX_RELAY_EXACTLY_ONC", "OUTBOX_RELAY_EXACTLY_ONCE"),
                                          ("OUTBOX_RELAY_FOO", None)]
    from relay import cli

    # A bad log format stops it before it configures the logs (which would write to this
    # test's captured stdout, closed for every later test of the process).
    assert cli.main(["status", "--dsn", "postgresql://nobody@127.0.0.1:1/none"],
                    env={"OUTBOX_RELAY_KEEP_PUBLISH": "s3cret-looking", "OUTBOX_RELAY_LOG_FORMAT": "bogus"}) == 2
    err = capsys.readouterr().err
    assert ("warning: OUTBOX_RELAY_KEEP_PUBLISH is no option of outbox-relay (did you mean "
            "OUTBOX_RELAY_KEEP_PUBLISHED?): it is ignored") in err and "s3cret-looking" not in err
