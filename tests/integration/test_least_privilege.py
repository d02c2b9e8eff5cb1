"""The relay under its least-privilege role (outbox_core/sql/roles/outbox_relay_role.sql), issue 9.

The role script runs as the schema owner; a LOGIN role that is a member of the
NOLOGIN group role ``outbox_relay`` then runs the relay (publish, mark, retry,
dead-letter, leases), ``status``, ``cleanup`` and ``dead-letters list``.  The same
login role is refused everything else: business tables in the same database,
inserting events (``dead-letters requeue`` is an operator command), the
migrations table, DDL, role and superuser escapes.  A partitioned outbox works
for ``status``; its partition maintenance stays with the owner.

Both test servers authenticate 127.0.0.1 with ``trust``, so the login role's
password is set (as in production) but not checked here; password handling is
tested in tests/acceptance/test_secrets.py and test_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import psycopg.errors
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay import migrate
from relay.queries import sql_files
from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    pending,
    relay_cmd,
    scalar,
    wait_drained,
)
from tests.fixtures.procs import wait_until

ROLE_SCRIPT = sql_files() / "roles" / "outbox_relay_role.sql"  # package data: here and in a wheel


@dataclass(frozen=True)
class RelayLogin:
    admin_dsn: str  # the migrated test database, as its owner (a superuser)
    dsn: str  # the same database as the login role
    name: str


def apply_role_script(dsn: str) -> None:
    """The script as any deployment tool would run it: one execute, no psql."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ROLE_SCRIPT.read_bytes())


@contextmanager
def login_role(admin_dsn: str) -> Iterator[RelayLogin]:
    """The role script applied (twice: idempotent), a login role in it, and a business table."""
    apply_role_script(admin_dsn)
    apply_role_script(admin_dsn)
    name = f"outbox_relay_login_{uuid.uuid4().hex[:10]}"
    password = f"pw-{uuid.uuid4().hex}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE outbox_relay").format(
            sql.Identifier(name), sql.Literal(password)))
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, total numeric NOT NULL)")
        conn.execute("INSERT INTO orders VALUES (1, 10), (2, 20)")
    try:
        yield RelayLogin(admin_dsn=admin_dsn, name=name,
                         dsn=make_conninfo(admin_dsn, user=name, password=password))
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE usename = %s", (name,))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.fixture
def relay_login(outbox_db: str) -> Iterator[RelayLogin]:
    with login_role(outbox_db) as login:
        yield login


@pytest.fixture
def partitioned_login(db_dsn: str) -> Iterator[RelayLogin]:
    migrate.apply(db_dsn, partitioned=True)
    with login_role(db_dsn) as login:
        yield login


def cli(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OUTBOX_RELAY_DSN=dsn, OUTBOX_RELAY_LOG_FORMAT="json")
    return subprocess.run(relay_cmd(*args), env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_role_script_grants_exactly_the_documented_privileges(relay_login: RelayLogin) -> None:
    with psycopg.connect(relay_login.admin_dsn, autocommit=True) as conn:
        role = conn.execute("SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, "
                            "rolbypassrls FROM pg_roles WHERE rolname = 'outbox_relay'").fetchone()
        assert role == (False, False, False, False, False)
        table_privs = {
            (t, p) for t, p in conn.execute(
                "SELECT table_name, privilege_type FROM information_schema.role_table_grants "
                "WHERE grantee = 'outbox_relay' AND table_catalog = current_database()")
        }
        column_privs = {
            (t, c, p) for t, c, p in conn.execute(
                "SELECT table_name, column_name, privilege_type "
                "FROM information_schema.column_privileges WHERE grantee = 'outbox_relay' "
                "AND privilege_type = 'UPDATE' AND table_catalog = current_database()")
        }
        stats = conn.execute("SELECT pg_has_role('outbox_relay', 'pg_read_all_stats', 'MEMBER')"
                             ).fetchone()
    # No pg_read_all_stats: it would show the SQL text of every session of every database.
    assert stats == (False,)
    assert table_privs == {
        ("outbox", "SELECT"), ("outbox", "DELETE"),
        ("outbox_dead_letters", "SELECT"), ("outbox_dead_letters", "INSERT"),
        ("outbox_relay_shards", "SELECT"),
        ("outbox_relay_replicas", "SELECT"), ("outbox_relay_replicas", "INSERT"),
        ("outbox_relay_replicas", "DELETE"),
        ("outbox_relay_settings", "SELECT"),
        ("outbox_relay_replays", "SELECT"),  # replays (0007): read requests, finish them
        ("outbox_relay_replay_progress", "SELECT"), ("outbox_relay_replay_progress", "INSERT"),
        ("outbox_relay_replay_progress", "UPDATE"),
    }
    progress_columns = {c for t, c, _ in column_privs if t == "outbox_relay_replay_progress"}
    assert progress_columns >= {"published_at", "xid", "row_id", "sent", "done", "owner", "token"}
    column_privs = {p for p in column_privs if p[0] != "outbox_relay_replay_progress"}
    assert column_privs == {
        ("outbox", "published_at", "UPDATE"), ("outbox", "attempts", "UPDATE"),
        ("outbox", "last_error", "UPDATE"), ("outbox", "retry_at", "UPDATE"), ("outbox", "xid", "UPDATE"),
        ("outbox_relay_shards", "owner", "UPDATE"), ("outbox_relay_shards", "lease_until", "UPDATE"),
        ("outbox_relay_shards", "token", "UPDATE"),
        ("outbox_relay_replicas", "seen_until", "UPDATE"), ("outbox_relay_replicas", "stalled", "UPDATE"),
        ("outbox_relay_replays", "state", "UPDATE"), ("outbox_relay_replays", "finished_at", "UPDATE"),
    }
    with psycopg.connect(relay_login.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE'), "
                            "pg_has_role(current_user, 'pg_monitor', 'USAGE')"
                            ).fetchone() == (False, False)


def test_role_script_converges_after_a_wider_grant(relay_login: RelayLogin) -> None:
    with psycopg.connect(relay_login.admin_dsn, autocommit=True) as conn:
        conn.execute("GRANT ALL ON outbox, outbox_schema_migrations TO outbox_relay")
        conn.execute("ALTER ROLE outbox_relay LOGIN CREATEDB")
        conn.execute("GRANT pg_read_all_stats TO outbox_relay")  # what older scripts granted
    apply_role_script(relay_login.admin_dsn)
    with psycopg.connect(relay_login.admin_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT has_table_privilege('outbox_relay', 'outbox', 'INSERT'), "
                            "has_table_privilege('outbox_relay', 'outbox_schema_migrations', "
                            "'SELECT')").fetchone() == (False, False)
        assert conn.execute("SELECT rolcanlogin, rolcreatedb FROM pg_roles "
                            "WHERE rolname = 'outbox_relay'").fetchone() == (False, False)
        assert conn.execute("SELECT pg_has_role('outbox_relay', 'pg_read_all_stats', 'MEMBER')"
                            ).fetchone() == (False,)


def test_role_script_refuses_a_database_without_the_schema(db_dsn: str) -> None:
    with pytest.raises(psycopg.errors.RaiseException, match="run `outbox-relay migrate` first"):
        apply_role_script(db_dsn)


def test_relay_publishes_marks_leases_and_dead_letters_under_the_role(
        relay_login: RelayLogin, broker, topic, pg_server, request) -> None:
    admin = relay_login.admin_dsn
    # A transaction in flight in another database (xids are cluster-wide): the role sees
    # its database in pg_stat_activity, so it does not hold the publish horizon back.
    other_database = psycopg.connect(pg_server.admin_dsn)
    request.addfinalizer(other_database.close)
    other_database.execute("SELECT pg_current_xact_id()")
    insert_rows(admin, topic, 60, keys=6)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload, headers) "
                     "VALUES (%s, 'poison', '{}', '{\"n\": 1}')", (topic,))
    with psycopg.connect(admin) as conn:
        expected = {str(r[0]) for r in conn.execute(
            "SELECT event_id FROM outbox WHERE key <> 'poison'")}

    # max_attempts 2: the poison row goes through record_failure once, then dead_letter.
    with RelayThread(relay_login.dsn, broker.bootstrap, max_attempts=2,
                     backoff_max_s=0.3) as r:
        wait_drained(admin, timeout_s=60)
        wait_until(lambda: scalar(admin, "SELECT count(*) FROM outbox_dead_letters") == 1,
                   timeout_s=30, message="poison row not dead-lettered")
        owner = r.relay.settings.owner
        held = scalar(admin, "SELECT count(*) FROM outbox_relay_shards WHERE owner = %(o)s",
                      {"o": owner})
        assert held == 16
        assert scalar(admin, "SELECT count(*) FROM outbox_relay_replicas WHERE owner = %(o)s",
                      {"o": owner}) == 1
        assert r.relay.fatal is None
        session_user = scalar(admin, "SELECT string_agg(DISTINCT usename, ',') FROM "
                                     "pg_stat_activity WHERE datname = current_database() "
                                     "AND application_name LIKE 'outbox-relay%%'")
        assert session_user == relay_login.name
    other_database.rollback()
    other_database.close()
    assert r.exit_code == 0
    # A clean stop released every lease and forgot the replica (UPDATE and DELETE worked).
    assert scalar(admin, "SELECT count(*) FROM outbox_relay_shards WHERE owner IS NOT NULL") == 0
    assert scalar(admin, "SELECT count(*) FROM outbox_relay_replicas") == 0
    dead = scalar(admin, "SELECT row_to_json(d)::text FROM outbox_dead_letters d")
    assert json.loads(dead)["reason"] == "bad_headers" and json.loads(dead)["attempts"] == 2

    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=60), expected)
    assert not delivery.missing and not delivery.order_violations

    # The admin commands the relay's role is meant to run.
    status = cli("status", "--json", dsn=relay_login.dsn)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["pending"] == 0 and report["dead_letters"] == 1 and len(report["shards"]) == 16
    listed = cli("dead-letters", "list", "--json", dsn=relay_login.dsn)
    assert listed.returncode == 0, listed.stderr
    assert [d["key"] for d in json.loads(listed.stdout)] == ["poison"]
    cleaned = cli("cleanup", "--cleanup-retention-s", "0.001", dsn=relay_login.dsn)
    assert cleaned.returncode == 0, cleaned.stderr
    assert "deleted 60 published rows" in cleaned.stdout
    assert scalar(admin, "SELECT count(*) FROM outbox") == 0

    # Requeue writes events: an operator command, refused to the relay's role with one line.
    refused = cli("dead-letters", "requeue", "--all", dsn=relay_login.dsn)
    assert refused.returncode == 1
    line = one_line(refused)  # and says whose DSN would do: the runbooks ran it in the sidecar
    assert "permission denied" in line and "an operator role" in line
    purge = cli("dead-letters", "purge", "--all", dsn=relay_login.dsn)
    assert purge.returncode == 1 and "dead-letters purge writes" in one_line(purge)
    assert scalar(admin, "SELECT count(*) FROM outbox_dead_letters") == 1
    requeued = cli("dead-letters", "requeue", "--all", dsn=admin)
    assert requeued.returncode == 0, requeued.stderr
    assert scalar(admin, "SELECT count(*) FROM outbox WHERE key = 'poison'") == 1


#: Statements the relay's role must be refused (SQLSTATE 42501), each on its own.
FORBIDDEN = [
    # a business table in the same database
    "SELECT * FROM orders",
    "UPDATE orders SET total = 0",
    "DELETE FROM orders",
    "INSERT INTO orders VALUES (3, 30)",
    "COPY orders TO STDOUT",
    # events are written by services, never by the relay
    "INSERT INTO outbox (topic, payload) VALUES ('t', '{}')",
    "UPDATE outbox SET topic = 'elsewhere'",
    "UPDATE outbox SET payload = '{}'",
    "UPDATE outbox SET headers = '{}'",
    "TRUNCATE outbox",
    # dead letters: insert only (dead_letter); purge and requeue are operator commands
    "UPDATE outbox_dead_letters SET reason = 'x'",
    "DELETE FROM outbox_dead_letters",
    # shards and settings belong to migrate
    "INSERT INTO outbox_relay_shards (shard) VALUES (9999)",
    "DELETE FROM outbox_relay_shards",
    "UPDATE outbox_relay_shards SET shard = shard + 100",
    "UPDATE outbox_relay_settings SET shards = 1",
    "DELETE FROM outbox_relay_settings",
    # tables the relay never reads
    "SELECT * FROM outbox_schema_migrations",
    "SELECT * FROM outbox_inbox",
    # DDL
    "CREATE TABLE evil (id int)",
    "CREATE SCHEMA evil",
    "CREATE INDEX ON outbox (topic)",
    "CREATE FUNCTION evil() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "ALTER TABLE outbox ADD COLUMN evil int",
    "ALTER TABLE orders OWNER TO CURRENT_USER",
    "DROP TABLE orders",
    "DROP TABLE outbox",
    "DROP TRIGGER outbox_notify_insert ON outbox",
    "CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql "
    "AS 'BEGIN RETURN NULL; END'",
    # escapes
    "SET ROLE postgres",
    "CREATE ROLE evil",
    "ALTER ROLE outbox_relay LOGIN",
    "CREATE DATABASE evil",
    "SELECT pg_read_file('/etc/hostname')",
    "COPY (SELECT 1) TO '/tmp/outbox_relay_evil'",
]


def test_the_role_is_refused_everything_else(relay_login: RelayLogin) -> None:
    allowed: list[str] = []
    with psycopg.connect(relay_login.dsn, autocommit=True) as conn:
        for statement in FORBIDDEN:
            try:
                conn.execute(statement.encode())
                allowed.append(statement)
            except psycopg.errors.InsufficientPrivilege:
                pass
    assert allowed == [], f"the relay's role may run: {allowed}"
    with psycopg.connect(relay_login.admin_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (2,)
        assert conn.execute("SELECT to_regclass('evil')").fetchone() == (None,)
    # `migrate` needs the owner role; the relay's role gets one clear line.
    refused = cli("migrate", dsn=relay_login.dsn)
    assert refused.returncode != 0
    line = one_line(refused)
    assert "permission denied" in line or "may create tables" in line


def test_replay_requests_are_the_operators_not_the_relays(relay_login: RelayLogin) -> None:
    """The relay's role may not request a replay: it said only "permission denied for table
    outbox_relay_replays" (an audit of the relay's operation); now it says whose DSN to use.
    The operator role the script's comment shows may, with the grant it lists for it."""
    refused = cli("replay", "--since", "2000-01-01", dsn=relay_login.dsn)
    assert refused.returncode != 0
    line = one_line(refused)
    assert "outbox_relay_replays" in line and "operator role" in line, line
    operator, password = f"outbox_operator_{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex}"
    example = ROLE_SCRIPT.read_text()
    grants = [line.removeprefix("--").strip().split("  --")[0].rstrip(";")
              for line in example.splitlines() if "TO outbox_relay_operator" in line]
    assert len(grants) == 3, grants  # the requeue's and purge's, and the replay's
    group = f"outbox_relay_operator_{uuid.uuid4().hex[:8]}"  # roles are the server's: one a run
    with psycopg.connect(relay_login.admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN IN ROLE outbox_relay").format(sql.Identifier(group)))
        for grant in grants:
            conn.execute(grant.replace("outbox_relay_operator", group).encode())
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
            sql.Identifier(operator), sql.Literal(password), sql.Identifier(group)))
    try:
        made = cli("replay", "--since", "2000-01-01", dsn=make_conninfo(relay_login.dsn, user=operator,
                                                                         password=password))
        assert made.returncode == 0, made.stderr
        assert "requested" in made.stdout
    finally:
        with psycopg.connect(relay_login.admin_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (operator,))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(operator)))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(group)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(group)))


def test_partitioned_outbox_status_under_the_role_and_partitions_with_the_owner(
        partitioned_login: RelayLogin, topic) -> None:
    """Grants on the parent cover what `status` reads through it; partition maintenance
    (`cleanup`) is DDL and reads partitions directly: the owner's job, one clear line here."""
    insert_rows(partitioned_login.admin_dsn, topic, 5)
    status = cli("status", "--json", dsn=partitioned_login.dsn)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["pending"] == 5
    refused = cli("cleanup", "--cleanup-retention-s", "1", dsn=partitioned_login.dsn)
    assert refused.returncode == 1
    assert "permission denied" in one_line(refused)
    owner = cli("cleanup", "--cleanup-retention-s", "1", dsn=partitioned_login.admin_dsn)
    assert owner.returncode == 0, owner.stderr


def test_partitioned_outbox_relays_under_the_role(partitioned_login: RelayLogin, broker,
                                                  topic) -> None:
    admin = partitioned_login.admin_dsn
    insert_rows(admin, topic, 30, keys=3)
    r = RelayThread(partitioned_login.dsn, broker.bootstrap).start()
    try:
        wait_until(lambda: r.relay.stopped.is_set() or pending(admin) == 0, timeout_s=60,
                   message=lambda: f"{pending(admin)} rows pending")
    finally:
        r.stop()
    assert pending(admin) == 0


def test_the_deploy_example_login_runs_the_relay(outbox_db: str, broker, topic) -> None:
    """The login role of deploy/k8s/secret.example.yaml, created as the role script says,
    runs the relay end to end (issue 15, item 9: the example named the NOLOGIN group role)."""
    import yaml
    from psycopg.conninfo import conninfo_to_dict

    secret = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "secret.example.yaml").read_text())
    user = conninfo_to_dict(secret["stringData"]["dsn"])["user"]
    apply_role_script(outbox_db)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,)).fetchone()
        if exists is None:  # roles are cluster-wide: created once, as the script's comment says
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD 'CHANGE-ME' IN ROLE outbox_relay").format(
                sql.Identifier(user)))
    dsn = make_conninfo(outbox_db, user=user, password="CHANGE-ME")
    insert_rows(outbox_db, topic, 20, keys=4)
    expected = all_event_ids(outbox_db)
    r = RelayThread(dsn, broker.bootstrap).start()
    try:
        wait_until(lambda: r.relay.stopped.is_set() or pending(outbox_db) == 0, timeout_s=60,
                   message=lambda: f"{pending(outbox_db)} rows pending")
        assert r.relay.fatal is None and not r.relay.stopped.is_set()
    finally:
        r.stop()
    assert pending(outbox_db) == 0
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=20), expected)
    assert not delivery.missing and not delivery.order_violations
