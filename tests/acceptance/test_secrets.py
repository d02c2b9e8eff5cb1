"""Secrets never show, and the metrics server is read-only and binds where it is told (issue 9).

A DSN password, a SASL password and a TLS key passphrase are given to the real CLI
through environment variables and, in a second round, through ``..._FILE``
variables (as Kubernetes mounts secrets).  Every byte the CLI writes (stdout,
stderr, JSON logs at debug level), ``--help``, ``status``, ``/metrics``,
``/healthz`` and ``/readyz`` of a running relay, and the CLI's error lines for
failing runs, are collected and searched for the three secrets.

Both test servers trust 127.0.0.1, so the DSN password is carried everywhere a
real one would be but not checked; rejected credentials are covered by
tests/acceptance/test_cli.py::test_rejected_credentials.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import subprocess
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.config import build_settings
from relay.errors import ConfigError
from tests.fixtures.outbox import insert_rows, relay_cmd, relay_env, wait_drained
from tests.fixtures.procs import free_port, wait_until

# Fresh secrets every run, the same in every xdist worker (they parametrize test ids).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
DB_PASSWORD = f"db-pw-{hashlib.sha256(f'{_RUN}/db'.encode()).hexdigest()[:12]}"
SASL_PASSWORD = f"sasl-pw-{hashlib.sha256(f'{_RUN}/sasl'.encode()).hexdigest()[:12]}"
KEY_PASSPHRASE = f"key-pass-{hashlib.sha256(f'{_RUN}/key'.encode()).hexdigest()[:12]}"
SECRETS = (DB_PASSWORD, SASL_PASSWORD, KEY_PASSPHRASE)


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked in {where}:\n{text[-3000:]}"


def uri_with_password(dsn: str, password: str) -> str:
    """The test database's DSN as a URI with a password (percent-encoded)."""
    f = conninfo_to_dict(dsn)
    return (f"postgresql://{quote(str(f.get('user') or 'postgres'))}:{quote(password, safe='')}"
            f"@{f.get('host') or '127.0.0.1'}:{f.get('port') or 5432}/{f['dbname']}")


@dataclass
class SecretEnv:
    """The relay's environment with the three secrets, the way a deployment sets them."""

    env: dict[str, str]
    mode: str
    outputs: list[tuple[str, str]] = field(default_factory=list)

    def cli(self, *args: str, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(relay_cmd(*args), env={**self.env, **extra}, capture_output=True,
                                text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        self.outputs.append((" ".join(args), result.stdout + result.stderr))
        return result

    def check(self) -> None:
        for where, text in self.outputs:
            assert_no_secret(text, where)


@pytest.fixture(params=["env", "file"])
def secret_env(request: pytest.FixtureRequest, outbox_db: str, broker, tmp_path: Path) -> SecretEnv:
    env = relay_env(outbox_db, broker.bootstrap, log_level="debug")
    kafka = {"SASL_USERNAME": "relay", "SASL_MECHANISM": "PLAIN"}  # unused by PLAINTEXT
    if request.param == "env":
        env["OUTBOX_RELAY_DSN"] = uri_with_password(outbox_db, DB_PASSWORD)
        kafka.update(SASL_PASSWORD=SASL_PASSWORD, SSL_KEY_PASSWORD=KEY_PASSPHRASE)
    else:
        del env["OUTBOX_RELAY_DSN"]
        secrets = tmp_path / "secrets"
        secrets.mkdir(mode=0o700)
        for name, value in (("dsn", make_conninfo(outbox_db, password=DB_PASSWORD)),
                            ("sasl", SASL_PASSWORD), ("key", KEY_PASSPHRASE)):
            (secrets / name).write_text(value + "\n")  # as `kubectl create secret` may leave it
        env["OUTBOX_RELAY_DSN_FILE"] = str(secrets / "dsn")
        env["OUTBOX_RELAY_KAFKA_SASL_PASSWORD_FILE"] = str(secrets / "sasl")
        env["OUTBOX_RELAY_KAFKA_SSL_KEY_PASSWORD_FILE"] = str(secrets / "key")
    env.update({f"OUTBOX_RELAY_KAFKA_{k}": v for k, v in kafka.items()})
    return SecretEnv(env, mode=request.param)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:  # 503 from a failing probe still has a body
        return exc.code, exc.read().decode()


def test_no_secret_in_cli_output_logs_status_or_metrics(secret_env: SecretEnv, outbox_db, topic,
                                                        spawn) -> None:
    s = secret_env
    commands = ([("--help",), ("run", "--help"), ("migrate",), ("status",)] if s.mode == "env"
                else [("status", "--help"), ("migrate",), ("status", "--json"),
                      ("dead-letters", "list", "--json")])
    for args in commands:
        assert s.cli(*args).returncode == 0, s.outputs[-1]

    # A running relay, publishing, at debug level, scraped.
    port = free_port()
    relay = spawn(relay_cmd("run"), env={**s.env, "OUTBOX_RELAY_METRICS_PORT": str(port),
                                         "OUTBOX_RELAY_METRICS_HOST": "127.0.0.1"}, name="relay")
    relay.wait_for_log("http_listening", timeout_s=30)
    insert_rows(outbox_db, topic, 50, keys=5)
    wait_drained(outbox_db, timeout_s=60)
    wait_until(lambda: "outbox_relay_events_published_total" in get(port, "/metrics")[1],
               timeout_s=30, message="no publish in /metrics")
    for path in ("/metrics", "/healthz", "/readyz", "/nope"):
        status, body = get(port, path)
        assert status in (200, 404, 503)
        assert_no_secret(body, path)
    relay.sigterm()
    assert relay.wait(30) == 0
    log = relay.log_text()
    assert '"event": "relay_starting"' in log and "***" in log  # the masked settings were logged
    assert_no_secret(log, "the relay's log")
    s.check()


@pytest.mark.parametrize("mode", ["env", "file"])
def test_failing_runs_show_no_secret(mode: str, outbox_db, broker, tmp_path: Path) -> None:
    closed = free_port()
    bad_dsns = {
        "unreachable database": f"postgresql://postgres:{DB_PASSWORD}@127.0.0.1:{closed}/x",
    }
    if mode == "env":
        bad_dsns.update({"malformed port": f"postgresql://u:{DB_PASSWORD}@db:notaport/app",
                         "raw % in the password": f"postgresql://u:{DB_PASSWORD}%zz@db/app"})
    else:
        bad_dsns.update({"raw space in the password": f"postgresql://u:{DB_PASSWORD} x@db/app",
                         "unterminated quote": f"host=db password='{DB_PASSWORD}",
                         "unquoted space": f"host=db password={DB_PASSWORD} x dbname=app"})
    for label, dsn in bad_dsns.items():
        env = relay_env(dsn, broker.bootstrap, log_level="debug")
        env.update(OUTBOX_RELAY_KAFKA_SASL_PASSWORD=SASL_PASSWORD,
                   OUTBOX_RELAY_KAFKA_SSL_KEY_PASSWORD=KEY_PASSPHRASE)
        if mode == "file":
            (tmp_path / "dsn").write_text(dsn)
            del env["OUTBOX_RELAY_DSN"]
            env["OUTBOX_RELAY_DSN_FILE"] = str(tmp_path / "dsn")
        if label == "unreachable database":
            proc = subprocess.Popen(relay_cmd("run"), env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            try:
                out = proc.stdout.readline() if proc.stdout else ""
                lines = [out]
                while "database_unavailable" not in out:
                    out = proc.stdout.readline() if proc.stdout else ""
                    assert out, "relay exited before reporting the database"
                    lines.append(out)
            finally:
                # SIGKILL, not SIGTERM: a SIGTERM that lands while the relay writes a log
                # line deadlocks it today (see the issue-9 report); not this test's subject.
                proc.kill()
                rest, _ = proc.communicate(timeout=30)
            text = "".join(lines) + rest
        else:
            result = subprocess.run(relay_cmd("run"), env=env, capture_output=True, text=True,
                                    timeout=60, stdin=subprocess.DEVNULL)
            assert result.returncode == 2, (label, result.stderr)
            assert "not a valid PostgreSQL connection string" in result.stderr, (label, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1, (label, result.stderr)
            text = result.stdout + result.stderr
        assert "Traceback" not in text, (label, text)
        assert_no_secret(text, f"run with {label} ({mode})")

    if mode == "file":
        return
    # librdkafka refuses the TLS settings: the passphrase is not in its message.  (A key
    # file that is not there is refused before librdkafka sees it: one that is not a key.)
    env = relay_env(outbox_db, broker.bootstrap)
    (tmp_path / "not-a-key.pem").write_text("not a key\n")
    env.update(OUTBOX_RELAY_KAFKA_SECURITY_PROTOCOL="SSL",
               OUTBOX_RELAY_KAFKA_SSL_KEY_LOCATION=str(tmp_path / "not-a-key.pem"),
               OUTBOX_RELAY_KAFKA_SSL_KEY_PASSWORD=KEY_PASSPHRASE,
               OUTBOX_RELAY_KAFKA_SASL_PASSWORD=SASL_PASSWORD)
    result = subprocess.run(relay_cmd("run"), env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid Kafka configuration" in result.stderr, result.stderr
    assert_no_secret(result.stdout + result.stderr, "a refused TLS key")

    # A secret under a misspelt name: librdkafka refuses the name, and its value was logged in
    # clear first, in relay_starting's settings (found by an audit of the command line).
    for name in ("SASL_PASSWD", "SASL_PASWORD"):
        env = relay_env(outbox_db, broker.bootstrap, log_level="debug")
        env[f"OUTBOX_RELAY_KAFKA_{name}"] = SASL_PASSWORD
        result = subprocess.run(relay_cmd("run"), env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "No such configuration property" in result.stderr, result.stderr
        assert_no_secret(result.stdout + result.stderr, f"a secret under {name}")


@pytest.mark.parametrize("dsn", [
    f"postgresql://relay:{DB_PASSWORD}@db:notaport/app",
    f"postgresql://relay:{DB_PASSWORD}%@db/app",
    f"postgresql://relay:{DB_PASSWORD} x@db/app",
    f"postgresql://relay:{DB_PASSWORD}@db/app?sslmode=sometimes",
    f"postgresql://relay:{DB_PASSWORD}@[db/app",
    f"postgresql://:{DB_PASSWORD}@db:x/app",
    f"postgresql://relay:pre/{DB_PASSWORD}@db/app",
    f"postgresql://db/app?password={DB_PASSWORD}&bogus=1",
    f"host=db password='{DB_PASSWORD}",
    f"host=db password={DB_PASSWORD} port=x",
    f"host=db password={DB_PASSWORD} and more",
    f"host=db password = '{DB_PASSWORD}' sslmode=sometimes",
])
def test_config_error_for_a_malformed_dsn_hides_the_password(dsn: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_settings({"dsn": dsn, "bootstrap_servers": "k:9092"})
    message = str(info.value)
    assert "not a valid PostgreSQL connection string" in message
    assert_no_secret(message, "the ConfigError")
    assert_no_secret(repr(info.value), "the ConfigError's repr")


def listening_addresses(port: int) -> set[str]:
    """Local IPv4/IPv6 addresses with a socket in LISTEN state on ``port`` (from /proc)."""
    found: set[str] = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] == "0A" and int(port_hex, 16) == port:
                if width == 8:
                    found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
                else:
                    raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, 32, 8))
                    found.add(socket.inet_ntop(socket.AF_INET6, raw))
    return found


def other_local_address() -> str | None:
    """A non-loopback IPv4 address of this host, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only picks the source address
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def request(port: int, method: str, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=b'{"stop": true}' if method != "GET" else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_metrics_server_binds_the_configured_address_and_only_reads(outbox_db, broker, spawn) -> None:
    port = free_port()
    env = relay_env(outbox_db, broker.bootstrap, metrics_port=port, metrics_host="127.0.0.1")
    relay = spawn(relay_cmd("run"), env=env, name="relay")
    relay.wait_for_log("leases_changed", timeout_s=30)
    assert listening_addresses(port) == {"127.0.0.1"}
    other = other_local_address()
    if other is not None:
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=2).close()

    def leases() -> list[tuple[int, str | None, int]]:
        with psycopg.connect(outbox_db) as conn:
            return conn.execute("SELECT shard, owner, token FROM outbox_relay_shards "
                                "ORDER BY shard").fetchall()

    before = leases()
    for path in ("/metrics", "/healthz", "/readyz", "/"):
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            status, _ = request(port, method, path)
            assert status in (405, 501), (method, path, status)
    assert request(port, "GET", "/readyz")[0] == 200
    assert request(port, "GET", "/healthz")[0] == 200
    assert relay.alive and leases() == before  # nothing stopped, released or changed
    assert "signal_received" not in relay.log_text() and "relay_draining" not in relay.log_text()
    relay.sigterm()
    assert relay.wait(30) == 0


def test_metrics_host_can_be_every_address_when_asked(outbox_db, broker, spawn) -> None:
    """The default (0.0.0.0, for kubelet probes) is an explicit choice, and it shows in /proc."""
    port = free_port()
    env = relay_env(outbox_db, broker.bootstrap, metrics_port=port, metrics_host="0.0.0.0")
    relay = spawn(relay_cmd("run"), env=env, name="relay")
    relay.wait_for_log("http_listening", timeout_s=30)
    assert listening_addresses(port) == {"0.0.0.0"}
    relay.sigterm()
    assert relay.wait(30) == 0



@pytest.mark.parametrize("problem", ["not a local address", "port taken"])
def test_a_metrics_address_that_cannot_be_bound_is_one_clear_line(problem: str, outbox_db,
                                                                   broker) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        host, port = (("192.0.2.1", free_port()) if problem == "not a local address"
                      else ("127.0.0.1", taken.getsockname()[1]))
        env = relay_env(outbox_db, broker.bootstrap, metrics_port=port, metrics_host=host)
        result = subprocess.run(relay_cmd("run"), env=env, capture_output=True, text=True,
                                timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--metrics-" in lines[0], result.stderr
