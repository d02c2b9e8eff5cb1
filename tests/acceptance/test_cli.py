"""The real CLI as a process: bad input gets one clear line and an exit code, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.fixtures.outbox import insert_rows, relay_cmd, relay_env, scalar
from tests.fixtures.procs import free_port


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(relay_cmd(*args), env=full_env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def one_clear_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("outbox-relay")
    return lines[0]


@pytest.mark.parametrize("command", [("run",), ("status",), ("dead-letters", "list"), ("replay",)])
def test_unknown_option(command):
    """Named by the command's own usage: it pointed at `outbox-relay --help`, which lists the
    commands and none of their options."""
    result = run_cli(*command, "--bogus-flag")
    assert result.returncode == 2
    line = one_clear_line(result)
    assert "unrecognized arguments: --bogus-flag" in line
    assert f"see outbox-relay {' '.join(command)} --help" in line, line


def test_missing_dsn():
    result = run_cli("run", env={"OUTBOX_RELAY_DSN": "", "OUTBOX_RELAY_BOOTSTRAP_SERVERS": "x:1"})
    assert result.returncode == 2
    assert "OUTBOX_RELAY_DSN" in one_clear_line(result)


@pytest.mark.parametrize("dsn", ["host=db port=notaport password=hunter2", "nonsense-dsn",
                                 "postgresql://u:hunter2@db/app?sslmode=sometimes",
                                 # libpq quoted the word without "=": a password given alone
                                 # (a DSN file holding only it), or its half after a space
                                 "hunter2", "host=db password=abc hunter2"])
def test_malformed_dsn(dsn):
    result = run_cli("run", "--dsn", dsn, "--bootstrap-servers", "127.0.0.1:1")
    assert result.returncode == 2
    line = one_clear_line(result)
    assert "not a valid PostgreSQL connection string" in line
    assert "hunter2" not in result.stderr + result.stdout


@pytest.mark.parametrize("option", ["target_session_attrs=bogus", "keepalives=abc", "gssencmode=bogus",
                                    "load_balance_hosts=bogus"])
def test_an_option_value_libpq_refuses_only_when_it_connects_is_a_bad_dsn(option):
    """libpq parses these DSNs and refuses the value only when it connects; the relay read
    that as an unreachable database and `run` waited for it for ever.  The line names where
    the string came from, as the checks at start do, and not libpq's wrapping ("invalid
    PostgreSQL connection string: connection is bad: connection to server at ... failed:")."""
    dsn = f"postgresql://u:hunter2@127.0.0.1:{free_port()}/app?{option}"
    for command in (("run", "--bootstrap-servers", "127.0.0.1:1"), ("status",)):
        result = run_cli(*command, "--dsn", dsn, timeout=60)
        assert result.returncode == 2, (command, result.stderr[-2000:])
        line = one_clear_line(result)
        assert "connection string" in line and option.split("=")[0] in line
        assert "--dsn / OUTBOX_RELAY_DSN is not a valid" in line, line
        assert "connection is bad" not in line and "connection to server" not in line, line
        assert "hunter2" not in result.stderr + result.stdout


def test_bad_number_names_the_option():
    result = run_cli("run", "--dsn", "postgresql://x/y", "--bootstrap-servers", "k:1",
                     "--batch-size", "lots")
    assert result.returncode == 2
    assert "--batch-size" in one_clear_line(result)


@pytest.mark.parametrize(("args", "named"), [
    (("run", "--bootstrap-servers", "k:1", "--batch-size", "99999999999999999999999"), "--batch-size"),
    (("run", "--bootstrap-servers", "k:1", "--lease-duration-s", "1e300"), "--lease-duration-s"),
    (("cleanup", "--cleanup-retention-s", "1e300"), "--cleanup-retention-s"),
    (("cleanup", "--cleanup-retention-s", "10", "--cleanup-batch", "99999999999999999999"), "--cleanup-batch"),
    (("dead-letters", "list", "--limit", "-1"), "--limit"),
    (("replay", "--since", "2h", "--rate", "inf"), "--rate"),
    (("replay", "--since", "2h", "--rate", "nan"), "--rate"),
    (("replay", "--since", "99999999999d"), "99999999999d"),
    (("replay", "--since", "2h", "--rate", "1e308"), "--rate"),  # finite, and fatal to relays
    (("replay", "--since", "2h", "--rate", "1e-300"), "--rate"),  # a replay that never sends
    # Stored as a year before 1 (or after 9999), which psycopg cannot read back: every relay
    # then died reading the replays, and status, replay list and the console with them.
    (("replay", "--since", "0001-01-01T00:00:00+14:00"), "outside 1970-01-01"),
    (("replay", "--since", "9999-12-31T23:59:59-14:00"), "outside 1970-01-01"),
    (("replay", "--since", "2090-01-01"), "in the future"),  # a CheckViolation traceback
    (("migrate", "--shards", "100000"), "--shards"),  # past the settings table's CHECK
])
def test_a_value_out_of_any_range_is_refused_in_one_line(outbox_db, args, named):
    """Each of these passed the checks and reached the database (or a clock) as a number it
    cannot hold: a traceback, at start or after the relay had taken its leases; `replay
    --rate inf` was stored and then killed every relay that ran the replay."""
    result = run_cli(*args, "--dsn", outbox_db, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in one_clear_line(result)
    if args[0] == "replay":
        assert scalar(outbox_db, "SELECT count(*) FROM outbox_relay_replays") == 0


@pytest.mark.parametrize(("args", "named"), [
    (("replay", "list", "5"), "takes no ID"),
    (("replay", "list", "--since", "2h"), "--since"),
    (("replay", "cancel", "5", "--since", "2h", "--topic", "t"), "--since, --topic"),
    (("replay", "cancel", "5", "--rate", "10"), "--rate"),
    (("replay", "cancel", "5", "--dry-run"), "--dry-run"),
    (("replay", "cancel"), "the replay's ID"),
    (("replay", "--since", "2h", "--rate", "0"), "--rate"),
])
def test_a_replay_command_refuses_what_it_does_not_take_before_connecting(args, named):
    """`replay list 5` listed every replay and `replay cancel 5 --since 2h` cancelled replay 5,
    each dropping the rest in silence; a bad --rate was found only after connecting (exit 3
    with the database down, where the mistake is the command's).  Refused now, exit 2, with
    no database behind the DSN: nothing is asked of it."""
    result = run_cli(*args, "--dsn", f"postgresql://nobody@127.0.0.1:{free_port()}/none", timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in one_clear_line(result)


def test_a_replay_stored_with_a_time_psycopg_cannot_read_does_not_break_the_replay_list(outbox_db):
    """A replay stored before the CLI bounded its times (a year before 1 in UTC) could not
    be read back: `replay list`, `status`, the console and every relay's start died on it."""
    scalar(outbox_db, "INSERT INTO outbox_relay_replays (since, until, rate_per_s) "
                      "VALUES ('0001-01-01 00:00:00+14', now(), 10) RETURNING id")
    try:
        result = run_cli("replay", "list", "--json", "--dsn", outbox_db, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]
        (replay,) = json.loads(result.stdout)
        assert replay["since"].startswith("1970-01-01") and replay["state"] == "active"
        # --json was dropped in silence by `replay cancel` (it printed a sentence).
        result = run_cli("replay", "cancel", str(replay["id"]), "--json", "--dsn", outbox_db, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout) == {"cancelled": replay["id"]}
    finally:
        scalar(outbox_db, "DELETE FROM outbox_relay_replays RETURNING 1")


def test_a_bad_log_format_names_its_value_and_variable():
    """It said "--log-format/--log-level: must be one of ...", naming neither the value nor
    where it came from."""
    result = run_cli("status", "--dsn", "postgresql://x/y", env={"OUTBOX_RELAY_LOG_FORMAT": "fancy"})
    assert result.returncode == 2
    line = one_clear_line(result)
    assert "'fancy'" in line and "OUTBOX_RELAY_LOG_FORMAT" in line


@pytest.mark.parametrize(("args", "env", "named"), [
    ((), {"OUTBOX_RELAY_OWNER": "relay-\udcff"}, "OUTBOX_RELAY_OWNER"),
    (("--bootstrap-servers", "\udcff:9092"), {}, "the value after --bootstrap-servers"),
    (("--kafka-property=client.id=\udcff",), {}, "the value of --kafka-property"),
    ((), {"OUTBOX_RELAY_KAFKA_CLIENT_ID": "\udcff"}, "OUTBOX_RELAY_KAFKA_CLIENT_ID"),
])
def test_input_that_is_not_utf8_is_refused_in_one_line(args, env, named):
    """Bytes that are not UTF-8 in a variable or an argument reached psycopg or librdkafka
    as lone surrogates: a UnicodeEncodeError or a SystemError traceback."""
    dsn = f"postgresql://nobody@127.0.0.1:{free_port()}/none"
    result = run_cli("run", "--dsn", dsn, "--bootstrap-servers", "127.0.0.1:9", *args, env=env, timeout=20)
    assert result.returncode == 2
    assert f"{named} is not valid UTF-8 text" in one_clear_line(result)


@pytest.mark.parametrize(("args", "named"), [
    (("purge", "6802ca8b-db27-41d2-9955-ed1884f2bd28", "--all"), "not both"),
    (("requeue", "6802ca8b-db27-41d2-9955-ed1884f2bd28", "--all"), "not both"),
    (("show", "not-a-uuid"), "'not-a-uuid' is not an event_id"),
])
def test_dead_letter_ids_are_checked_before_anything_is_moved(args, named):
    """`purge ID --all` purged every dead letter, the ID ignored; a malformed id read as
    "no dead letter with event_id not-a-uuid"."""
    dsn = f"postgresql://nobody@127.0.0.1:{free_port()}/none"
    result = run_cli("dead-letters", *args, "--dsn", dsn, timeout=20)
    assert result.returncode == 2
    assert named in one_clear_line(result)


@pytest.mark.parametrize(("args", "named"), [
    (("--debezium-table", "outbox"), 'column "aggregatetype" does not exist'),  # not Debezium's
    (("--debezium-table", "dbz", "--view", "outbox"), '"outbox" is not a view'),
    (("--debezium-table", "dbz", "--view", "nosuch.v"), 'schema "nosuch" does not exist'),
])
def test_an_adoption_that_cannot_be_made_is_one_line(outbox_db, args, named):
    """Each was a traceback (UndefinedColumn, WrongObjectType, InvalidSchemaName)."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS dbz (id uuid PRIMARY KEY, aggregatetype text NOT NULL, "
                     "aggregateid text NOT NULL, type text NOT NULL, payload jsonb)")
    result = run_cli("migrate", *args, "--dsn", outbox_db, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in one_clear_line(result)
    assert scalar(outbox_db, "SELECT count(*) FROM information_schema.columns "
                             "WHERE column_name = 'relay_seq'") == 0  # rolled back


@pytest.mark.parametrize("args", [("--existing", "pending"), ("--view", "v"), ("--cloudevents-source", "s"),
                                  ("--print", "--debezium-table", "events")])
def test_adoption_options_without_an_adoption_are_refused(args):
    """These were ignored without a word: `migrate --existing pending` migrated and said
    nothing of the option, `migrate --print --debezium-table X` printed the migrations only."""
    result = run_cli("migrate", *args, "--dsn", "postgresql://nobody@127.0.0.1:1/none")
    assert result.returncode == 2
    assert "--debezium-table" in one_clear_line(result)


@pytest.mark.parametrize(("args", "named"), [
    (("--debezium-table", "bad name"), "--debezium-table/--view"),
    (("--debezium-table", "events", "--topic-template", "{nosuch}"), "--topic-template"),
    (("--debezium-table", "events", "--topic-template", "bad topic {type}"), "--topic-template"),
])
def test_adoption_options_are_checked_before_anything_is_migrated(args, named):
    """Each was refused only after the migrations had been applied to the database (an audit
    of the command line): here no server listens, so anything that connected first fails
    differently."""
    result = run_cli("migrate", *args, "--dsn", f"postgresql://nobody@127.0.0.1:{free_port()}/none", timeout=20)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in one_clear_line(result) and "migrations applied" not in result.stdout


@pytest.mark.parametrize("source", ["", " ", "orders service", "a\tb"])
def test_an_empty_or_spaced_cloudevents_source_is_refused_before_connecting(source):
    """`--cloudevents-source ''` was taken: every adopted row then carried an empty ce_source
    header, which CloudEvents forbids (a non-empty URI reference)."""
    result = run_cli("migrate", "--debezium-table", "events", "--cloudevents-source", source,
                     "--dsn", f"postgresql://nobody@127.0.0.1:{free_port()}/none", timeout=20)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--cloudevents-source" in one_clear_line(result) and "URI reference" in result.stderr


def test_missing_schema(db_dsn, broker):
    result = run_cli("run", env=relay_env(db_dsn, broker.bootstrap))
    assert result.returncode == 3
    assert "outbox-relay migrate" in one_clear_line(result)


def test_a_schema_older_than_the_relay_is_one_line_asking_for_migrate(outbox_db, broker):
    """A database without migration 0008 (its replicas' stalled column): run logged
    relay_started and died with a traceback (UndefinedColumn), status too (an audit of the
    relay's operation).  Now one line, exit 3, as for a schema that is not there."""
    import psycopg

    insert_rows(outbox_db, "t.older", 3)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox_relay_replicas DROP COLUMN stalled")
    for command in (("run",), ("status",)):
        result = run_cli(*command, env=relay_env(outbox_db, broker.bootstrap))
        assert result.returncode == 3, (command, result.stderr[-2000:])
        line = one_clear_line(result)
        assert "older than this relay" in line and "outbox-relay migrate" in line, line


def test_a_table_that_is_not_there_is_named_not_blamed_on_the_schema(outbox_db, broker):
    """A mistyped --table said "the outbox schema is missing: run outbox-relay migrate",
    which cannot help: the schema is there.  Now the line names the table and the option."""
    # dead-letters too (an audit of the command line): requeue blamed the schema, list exited 0.
    for command in (("run",), ("status",), ("dead-letters", "requeue", "--all"), ("dead-letters", "list")):
        result = run_cli(*command, "--table", "nosuch", env=relay_env(outbox_db, broker.bootstrap))
        assert result.returncode == 3, result.stderr[-2000:]
        line = one_clear_line(result)
        assert "'nosuch'" in line and "--table" in line and "run `outbox-relay migrate`" not in line


def test_a_table_that_is_not_an_outbox_is_refused_and_left_alone(outbox_db, broker):
    """--table naming another table was a traceback (UndefinedColumn) in status, replay and
    cleanup, and in `run` after it had taken every shard's lease; a table with the relay's
    id and published_at columns would have had its rows deleted by cleanup.  --table Outbox
    was looked up as outbox (folded) and then queried as "Outbox": "run migrate"."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (id bigint, published_at timestamptz)")
        conn.execute("INSERT INTO kept VALUES (1, now() - interval '1 day')")
    env = relay_env(outbox_db, broker.bootstrap)
    for command in (("run",), ("status",), ("cleanup", "--cleanup-retention-s", "1"),
                    ("replay", "--since", "2h", "--dry-run")):
        result = run_cli(*command, "--table", "kept", env=env)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "'kept' (--table / OUTBOX_RELAY_TABLE) is not an outbox: it has no column event_id" \
            in one_clear_line(result)
    assert scalar(outbox_db, "SELECT count(*) FROM kept") == 1
    assert scalar(outbox_db, "SELECT count(*) FROM outbox_relay_shards WHERE owner IS NOT NULL") == 0
    result = run_cli("status", "--table", "Outbox", env=env)
    assert result.returncode == 3 and "no table or view 'Outbox'" in one_clear_line(result)


@pytest.mark.parametrize(
    ("prop", "value", "fragment"),
    [
        ("NO_SUCH_PROPERTY", "1", "invalid Kafka configuration"),
        ("LINGER_MS", "soon", 'invalid Kafka configuration: Invalid value for configuration property "linger.ms"'),
        ("DELIVERY_TIMEOUT_MS", "-", 'property "delivery.timeout.ms"'),
        # OpenSSL's own words were "ssl.ca.location failed: ...::BIO lib"
        ("SSL_CA_LOCATION", "/nonexistent/ca.pem", "ssl.ca.location: '/nonexistent/ca.pem' does not exist"),
        ("ACKS", "1", "would break the relay's delivery guarantee"),
    ],
)
def test_malformed_librdkafka_property(outbox_db, broker, prop, value, fragment):
    env = relay_env(outbox_db, broker.bootstrap)
    env[f"OUTBOX_RELAY_KAFKA_{prop}"] = value
    result = run_cli("run", env=env)
    assert result.returncode == 2
    assert fragment in one_clear_line(result)


@pytest.fixture
def password_role(own_pg_running):
    """A role that must log in with a password on the restartable embedded server."""
    hba = Path(own_pg_running.data_dir) / "pg_hba.conf"
    original = hba.read_text()
    hba.write_text("host all pw_relay 127.0.0.1/32 scram-sha-256\n" + original)
    with psycopg.connect(own_pg_running.admin_dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS pw_relay")
        conn.execute("CREATE ROLE pw_relay LOGIN PASSWORD 'right-password'")
        conn.execute("SELECT pg_reload_conf()")
    try:
        yield own_pg_running
    finally:
        hba.write_text(original)
        with psycopg.connect(own_pg_running.admin_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("DROP ROLE IF EXISTS pw_relay")


def test_rejected_credentials(password_role, broker):
    dsn = f"postgresql://pw_relay:wrong-s3cret@127.0.0.1:{password_role.port}/postgres"
    result = run_cli("run", env=relay_env(dsn, broker.bootstrap))
    assert result.returncode == 4
    line = one_clear_line(result)
    assert "rejected the credentials" in line
    assert "wrong-s3cret" not in result.stderr + result.stdout


def test_the_console_refuses_rejected_credentials_and_a_missing_table_at_start(password_role, outbox_db):
    """The console started and served pages with credentials the server rejects or a
    --table that is not there: the error showed only on its pages and in its log."""
    dsn = f"postgresql://pw_relay:wrong-s3cret@127.0.0.1:{password_role.port}/postgres"
    result = run_cli("console", env=relay_env(dsn, "", console_port=0), timeout=30)
    assert result.returncode == 4
    assert "rejected the credentials" in one_clear_line(result)
    assert "wrong-s3cret" not in result.stderr + result.stdout
    result = run_cli("console", "--table", "nosuch", env=relay_env(outbox_db, "", console_port=0), timeout=30)
    assert result.returncode == 3
    assert "'nosuch'" in one_clear_line(result)


def test_the_console_starts_while_the_database_is_unreachable(spawn):
    env = relay_env(f"postgresql://postgres:pw-s3cret@127.0.0.1:{free_port()}/x", "", console_port=0)
    console = spawn(relay_cmd("console"), env=env, name="console")
    console.wait_for_log("console_database_unavailable", timeout_s=30)
    console.wait_for_log(re.compile(r"console listening on http://127\.0\.0\.1:\d+/"), timeout_s=30)
    assert console.alive
    console.sigterm()
    assert console.wait(30) == 0


def test_unreachable_database_is_waited_for_not_fatal(broker, spawn):
    port = free_port()
    relay = spawn(relay_cmd("run"), env=relay_env(f"postgresql://postgres:pw-s3cret@127.0.0.1:{port}/x",
                                                  broker.bootstrap), name="relay")
    relay.wait_for_log("database_unavailable", timeout_s=30)
    assert relay.alive
    relay.sigterm()
    assert relay.wait(30) == 0
    assert "pw-s3cret" not in relay.log_text()
    assert "Traceback" not in relay.log_text()


def test_a_tls_setup_that_cannot_work_is_refused_not_waited_for(outbox_db, broker):
    """sslmode=require against a server without SSL (the embedded one): libpq says so with
    no FATAL, and the relay read it as an unreachable database, so `run` waited for it
    forever and `status` said "database unreachable".  Now one line, exit 1, for both."""
    dsn = outbox_db + ("&" if "?" in outbox_db else "?") + "sslmode=require"
    for command in ("run", "status"):
        result = run_cli(command, env=relay_env(dsn, broker.bootstrap), timeout=60)
        assert result.returncode == 1, (command, result.stderr[-2000:])
        line = one_clear_line(result)
        assert "refused the connection" in line and "does not support SSL" in line


def test_a_java_jaas_config_is_refused_without_showing_its_password(outbox_db):
    """Someone coming from Java clients pastes sasl.jaas.config: the relay refuses it (a
    librdkafka client has no JAAS) and used to print it whole, password included, in its
    relay_starting line."""
    jaas = 'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="Kafk4S3cret";'
    env = relay_env(outbox_db, "127.0.0.1:1")
    env["OUTBOX_RELAY_KAFKA_SASL_JAAS_CONFIG"] = jaas
    result = run_cli("run", env=env, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Kafk4S3cret" not in result.stdout + result.stderr
    assert "JAAS" in result.stdout + result.stderr


def test_exactly_once_waits_for_an_unreachable_broker(outbox_db, spawn):
    """The README: an unreachable broker is waited for.  In exactly-once mode the relay's
    start-up read the position topic's metadata once and, with no broker answering, exited
    with code 2 ("cannot read metadata"), a configuration error, 17 s after it started."""
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, f"127.0.0.1:{free_port()}",
                                                  exactly_once="true", backoff_max_s="1"),
                  name="relay-eo")
    relay.wait_for_log(re.compile(r'exactly-once: cannot read metadata.*"event": "broker_unavailable"'),
                       timeout_s=60)
    assert relay.alive
    relay.sigterm()
    assert relay.wait(30) == 0
    assert "Traceback" not in relay.log_text()


def test_migrate_print_and_status_json(outbox_db):
    printed = run_cli("migrate", "--print")
    assert printed.returncode == 0
    assert "CREATE TABLE IF NOT EXISTS outbox" in printed.stdout
    status = run_cli("status", "--json", "--dsn", outbox_db)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["pending"] == 0 and report["oldest_pending_age_s"] == 0
    assert len(report["shards"]) == 16
    assert set(report["shards"][0]) >= {"shard", "owner", "lease_until", "token"}


@pytest.mark.parametrize(("args", "env", "named"), [
    (("--shards", "abc"), {}, "--shards"),
    (("--shards", "0"), {}, "--shards"),  # printed a script with no shard at all
    (("--lock-timeout-s", "soon"), {}, "--lock-timeout-s"),
    ((), {"OUTBOX_RELAY_SHARDS": "-3"}, "OUTBOX_RELAY_SHARDS"),
])
def test_migrate_print_refuses_a_bad_option_in_one_line(args, env, named):
    """`migrate --print --shards abc` was a ValueError traceback, and `--shards 0` printed a
    script that creates no shard row."""
    result = run_cli("migrate", "--print", *args, env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert named in one_clear_line(result)


def test_migrate_print_sets_the_lock_timeout_first():
    """The printed script waits for a table lock as long as `migrate` would, not forever."""
    printed = run_cli("migrate", "--print", "--lock-timeout-s", "2.5", "--shards", "4")
    assert printed.returncode == 0, printed.stderr
    statements = [line for line in printed.stdout.splitlines() if line and not line.startswith("--")]
    assert statements[0] == "SET lock_timeout = '2500ms';"
    assert "VALUES (true, 4)" in printed.stdout
    default = run_cli("migrate", "--print", env={"OUTBOX_RELAY_LOCK_TIMEOUT_S": "0.25"})
    assert "SET lock_timeout = '250ms';" in default.stdout


def test_python_dash_m_and_console_script_agree():
    module = subprocess.run([sys.executable, "-m", "relay", "--version"], capture_output=True, text=True)
    script = Path(sys.executable).with_name("outbox-relay")
    assert module.returncode == 0 and "outbox-relay" in module.stdout
    assert script.exists()
    console = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert console.stdout == module.stdout


def test_help_documents_every_env_var():
    from relay.config import OPTIONS

    text = run_cli("run", "--help").stdout
    for option in OPTIONS:
        if "run" in option.commands:
            assert option.env in text, option.env
    assert "OUTBOX_RELAY_KAFKA_" in text


def test_shard_count_change_is_refused_while_relays_hold_leases(outbox_db, broker, spawn):
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, broker.bootstrap), name="relay")
    relay.wait_for_log("leases_changed", timeout_s=30)
    refused = run_cli("migrate", "--dsn", outbox_db, "--shards", "8")
    assert refused.returncode == 2
    assert "while 16 shard lease(s) are live" in one_clear_line(refused)
    mismatched = run_cli("run", env=relay_env(outbox_db, broker.bootstrap, shards=8))
    assert mismatched.returncode == 2  # a configuration's mistake (it was 1, as a failure)
    assert "does not match the database's 16 shards" in one_clear_line(mismatched)
    relay.sigterm()
    assert relay.wait(30) == 0  # a clean stop releases every lease at once
    changed = run_cli("migrate", "--dsn", outbox_db, "--shards", "8")
    assert changed.returncode == 0, changed.stderr
    assert "shards_changed" in changed.stdout + changed.stderr  # not only "migrations applied: none"
    status = json.loads(run_cli("status", "--json", "--dsn", outbox_db).stdout)
    assert [s["shard"] for s in status["shards"]] == list(range(8))


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_rows_created_at_infinity_are_listed_shown_and_counted(outbox_db):
    """The schema allows created_at 'infinity' and '-infinity'.  `dead-letters list` and
    `show` failed with a traceback (psycopg: timestamp too large), hiding every dead letter,
    and `status --json` printed Infinity, which is no JSON (an audit with hostile rows)."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        for n, when in enumerate(("infinity", "-infinity", "2026-12-06 10:00:00+00")):
            conn.execute("INSERT INTO outbox_dead_letters (id, event_id, topic, key, payload, headers, created_at, "
                         "reason, error, attempts) VALUES (%s, gen_random_uuid(), 't', %s, '{}', '{}', %s, "
                         "'bad_headers', 'x', 3)", (n + 1, f"k{n}", when))
        conn.execute("INSERT INTO outbox (topic, key, payload, created_at) VALUES ('t', 'p', '{}', '-infinity')")
        event_id = conn.execute("SELECT event_id::text FROM outbox_dead_letters WHERE id = 1").fetchone()[0]
    env = relay_env(outbox_db, "")
    listed = run_cli("dead-letters", "list", "--json", env=env)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr[-2000:]
    created = sorted(d["created_at"] for d in _strict_json(listed.stdout))  # type: ignore[union-attr]
    assert created == ["-infinity", "2026-12-06T10:00:00+00:00", "infinity"]
    shown = run_cli("dead-letters", "show", event_id, env=env)
    assert shown.returncode == 0 and _strict_json(shown.stdout)["created_at"] == "infinity"  # type: ignore[index]
    status = run_cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr[-2000:]
    assert _strict_json(status.stdout)["oldest_pending_age_s"] is None  # type: ignore[index]
    text = run_cli("status", env=env)
    assert text.returncode == 0 and "oldest pending age:  unknown" in text.stdout
