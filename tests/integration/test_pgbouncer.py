"""Issue 15, item 7: the relay behind PgBouncer (and, issue 19, a job's one-round-trip fenced
write behind a transaction pooler).

In transaction mode the relay's session state (LISTEN, the wake-up advisory lock,
`synchronous_commit = off`) would land on borrowed server processes: it refuses to
start, with one line and exit code 5, before setting any of it.  In session mode it
runs as usual.  Debian's `pgbouncer` is started here on a free port in front of the
test PostgreSQL; without it the tests skip, except in CI (CI=true), where they fail."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    RelayThread,
    all_event_ids,
    check_delivery,
    insert_rows,
    relay_cmd,
    relay_env,
    wait_drained,
)
from tests.fixtures.procs import Proc, free_port, wait_until

MISSING = "pgbouncer not installed: apt-get install pgbouncer (.ci/run installs it)"


def _pgbouncer_bin() -> str:
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(p).exists()), None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(MISSING + "; CI must run these tests")
        pytest.skip(MISSING)
    return found


@pytest.fixture
def pgbouncer(db_dsn: str, tmp_path: Path, spawn: Callable[..., Proc]) -> Iterator[Callable[[str], str]]:
    """Factory: ``pgbouncer(pool_mode, pool_size=4)`` starts PgBouncer in front of ``db_dsn``'s
    server and returns ``db_dsn`` through it (``round_robin``: each transaction takes the
    server idle longest, not the one released last; ``port``: listen there, not on a free
    port of its own)."""
    binary = _pgbouncer_bin()
    target = conninfo_to_dict(db_dsn)
    user = str(target.get("user") or "postgres")

    def start(pool_mode: str, pool_size: int = 4, *, round_robin: bool = False,
              port: int | None = None) -> str:
        port = port or free_port()
        (tmp_path / "users.txt").write_text(f'"{user}" ""\n')
        ini = tmp_path / f"pgbouncer-{pool_mode}.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host={target.get('host', '127.0.0.1')} port={target.get('port', 5432)}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {tmp_path / 'users.txt'}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 100\n"
            "ignore_startup_parameters = options\n"
            f"server_round_robin = {int(round_robin)}\n")
        ini.chmod(0o644)
        tmp_path.chmod(0o755)
        (tmp_path / "users.txt").chmod(0o644)
        cmd = [binary, *(["-u", "nobody"] if os.geteuid() == 0 else []), str(ini)]
        spawn(cmd, name=f"pgbouncer-{pool_mode}")
        dsn = make_conninfo(db_dsn, host="127.0.0.1", port=str(port))

        def up() -> bool:
            with psycopg.connect(dsn, connect_timeout=2, autocommit=True) as conn:  # statement mode too
                return conn.execute("SELECT 1").fetchone() == (1,)

        wait_until(up, timeout_s=15, ignore=(psycopg.OperationalError,),
                   message="pgbouncer did not accept connections")
        return dsn

    yield start


def _settings_seen_through(dsn: str) -> set[str]:
    """synchronous_commit as seen by a few sessions through the pooler."""
    seen = set()
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(4)]
    try:
        for conn in conns:
            seen.add(conn.execute("SHOW synchronous_commit").fetchone()[0])  # type: ignore[index]
    finally:
        for conn in conns:
            conn.close()
    return seen


@pytest.mark.parametrize("mode", ["transaction", "statement"])
def test_relay_refuses_a_transaction_pooler_with_one_line(outbox_db, pgbouncer, broker, topic, spawn, mode):
    # In statement mode the probe's transaction block was refused, and the relay waited for
    # ever as for a database that is down (an audit of the relay's operation).
    with psycopg.connect(outbox_db, autocommit=True) as conn:  # durable commits by default
        conn.execute(sql.SQL("ALTER DATABASE {} SET synchronous_commit = on").format(
            sql.Identifier(conninfo_to_dict(outbox_db)["dbname"])))
    pooled = pgbouncer(mode)
    insert_rows(outbox_db, topic, 10)
    relay = spawn(relay_cmd("run"), env=relay_env(pooled, broker.bootstrap), name="relay")
    assert relay.wait(30) == 5
    lines = [line for line in relay.log_text().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and "transaction pooler" in errors[0], lines
    assert "Traceback" not in relay.log_text()
    # It refused before setting anything: the application's sessions keep durable commits.
    assert _settings_seen_through(pooled) == {"on"}
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone() == (10,)
        # This database's only: on a server shared by parallel tests (the PostgreSQL 15 tier)
        # other tests' sleeping relays hold the wake-up lock in their own databases.
        assert conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                            "database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                            ).fetchone() == (0,)


def test_relay_runs_behind_a_session_pooler(outbox_db, pgbouncer, broker, topic):
    pooled = pgbouncer("session")
    insert_rows(outbox_db, topic, 200, keys=10)
    expected = all_event_ids(outbox_db)
    with RelayThread(pooled, broker.bootstrap) as r:
        wait_drained(outbox_db, timeout_s=60)
        assert r.relay.fatal is None
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60),
                              expected)
    assert not delivery.missing and not delivery.order_violations


def test_a_pool_with_no_server_for_the_second_mark_connection_only_slows_the_relay(
        outbox_db, pgbouncer, broker, topic):
    # Room for the claims', the LISTEN, the replays' and the first mark connection: the
    # second mark connection's probe waits for a server that never comes free, and the relay
    # marks everything on the first (relay/marker.py), instead of a mark stuck behind it.
    pooled = pgbouncer("session", pool_size=4)
    insert_rows(outbox_db, topic, 6000, keys=20)
    expected = all_event_ids(outbox_db)
    with RelayThread(pooled, broker.bootstrap, batch_size=500, owner="small-pool", mark_connections=2) as r:
        wait_drained(outbox_db, timeout_s=90)
        assert r.relay.fatal is None
        with psycopg.connect(outbox_db, autocommit=True) as conn:  # directly, not through the pool
            apps = {row[0] for row in conn.execute(
                "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()")}
        assert "outbox-relay:small-pool:mark" in apps and "outbox-relay:small-pool:mark2" not in apps, apps
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60),
                              expected)
    assert not delivery.missing and not delivery.order_violations


def test_a_jobs_fenced_execute_behind_a_transaction_pooler_writes_once_and_stays_fenced(outbox_db, pgbouncer):
    """JobContext.fenced_execute prepares its fence on the connection; a transaction pooler
    moving a transaction to another server finds it missing there (prepared again, or
    given up after PREPARED_LOSSES_MAX losses in a row for fenced_transaction's way).  The
    writes still commit once each, fenced, and a lost lease still writes nothing."""
    from consumer_sdk.jobs import LeaseLost, NewJob, enqueue
    from consumer_sdk.jobs import queue as jobq
    from consumer_sdk.jobs.context import JobContext
    from consumer_sdk.jobs.model import Take

    with psycopg.connect(outbox_db, autocommit=True) as direct:
        direct.execute("CREATE TABLE pooled_effects (job_id bigint, token bigint, step int, "
                       "server int NOT NULL DEFAULT pg_backend_pid())")
        enqueue(direct, [NewJob(owner_id="o1", queue="interactive", kind="work", payload={})])
        (job,) = jobq.claim(direct, worker="A", takes=[Take(queue="interactive", owner_id="o1", n=1,
                                                             owner_limit=jobq.NO_OWNER_LIMIT)], lease_s=60)
    pooled = pgbouncer("transaction", pool_size=2)
    insert = "INSERT INTO pooled_effects (job_id, token, step) VALUES (%s, %s, %s)"
    with psycopg.connect(pooled, autocommit=True, prepare_threshold=None) as conn, \
            psycopg.connect(pooled) as other:
        ctx = JobContext(job, conn, deadline=float("inf"))
        for step in range(10):
            # Every other write, another client holds a server for the length of it: the
            # pooler gives this client's transaction the other one.
            if step % 2:
                other.execute("SELECT 1")
            assert ctx.fenced_execute(insert, (job.id, job.token, step)) == 1
            if step % 2:
                other.commit()
        with psycopg.connect(outbox_db, autocommit=True) as direct:  # taken over: a new token
            direct.execute("UPDATE jobs SET lease_token = lease_token + 1 WHERE id = %s", (job.id,))
        with pytest.raises(LeaseLost):
            ctx.fenced_execute(insert, (job.id, job.token, 99))
    with psycopg.connect(outbox_db, autocommit=True) as direct:
        assert direct.execute("SELECT step, count(*) FROM pooled_effects GROUP BY step ORDER BY step"
                              ).fetchall() == [(step, 1) for step in range(10)]
        # The writes went through several server sessions: the fence prepared on one was
        # missing on the next until each had it (or the connection gave it up).
        assert direct.execute("SELECT count(DISTINCT server) FROM pooled_effects").fetchone()[0] > 1


def test_an_inbox_statements_handler_behind_a_transaction_pooler_applies_each_event_once(outbox_db, pgbouncer):
    """A statements handler's one trip (issue 19) sends the prepared strict claim by name; a
    transaction pooler moving a trip to another server finds it missing there (the message
    goes the usual way and the claim is prepared again, or given up after the store's losses
    in a row for the claim bound as text).  Each event is applied once, and a redelivery
    of them all is dropped."""
    from consumer_sdk.testing import make_record

    pooled = pgbouncer("transaction", pool_size=2)
    store, processor, settled = _statements_processor(outbox_db, pooled, consumer="pooled",
                                                      table="pooled_inbox_effects")
    records = [make_record(value={"n": n}, offset=n) for n in range(12)]
    try:
        with psycopg.connect(pooled, prepare_threshold=None) as other:
            for n, record in enumerate(records):
                if n % 2:  # another client holds a server: this trip gets the other one
                    other.execute("SELECT 1")
                assert processor.process([record]).applied == 1
                if n % 2:
                    other.commit()
        assert processor.process(records).duplicates == len(records)
    finally:
        store.close()
    assert settled == records + records
    with psycopg.connect(outbox_db, autocommit=True) as direct:
        assert direct.execute("SELECT n, count(*) FROM pooled_inbox_effects GROUP BY n ORDER BY n"
                              ).fetchall() == [(n, 1) for n in range(12)]
        assert direct.execute("SELECT count(DISTINCT server) FROM pooled_inbox_effects").fetchone()[0] > 1


@pytest.mark.parametrize("batch_size", [1, 10])
def test_an_inbox_handler_behind_a_transaction_pooler_survives_psycopgs_own_prepared_statements(
        outbox_db, pgbouncer, batch_size):
    """psycopg prepares a statement it ran five times; behind a transaction pooler without
    prepared-statement support (this PgBouncer) the name it prepared on one server is
    unknown on the next, or taken there.  The handler running it failed, counted as an
    attempt (and dead-lettered once the attempts ran out).  Now the first such error turns
    psycopg's automatic preparing off for the store and retries the batch as a whole, as
    for a database that went away (DatabaseUnavailable, no attempt counted); never again
    after that."""
    import structlog

    from consumer_sdk.errors import DatabaseUnavailable
    from consumer_sdk.metrics import ConsumerMetrics
    from consumer_sdk.processor import Policies, Processor
    from consumer_sdk.store import PgInboxStore, connect_factory
    from consumer_sdk.testing import FakeDeadLetters, make_record
    from tests.integration.sdk._support import migrate_sdk_db

    migrate_sdk_db(outbox_db)
    with psycopg.connect(outbox_db, autocommit=True) as direct:
        direct.execute("CREATE TABLE pooled_handler_effects (n int, server int NOT NULL DEFAULT pg_backend_pid())")
    pooled = pgbouncer("transaction", pool_size=2)
    store = PgInboxStore(connect_factory(pooled))
    processor = Processor(
        consumer="pooled-h", store=store, dead_letters=FakeDeadLetters(), policies=Policies(),
        handler=lambda conn, m: conn.execute("INSERT INTO pooled_handler_effects (n) VALUES (%s)",
                                             (m.json()["n"],)),
        metrics=ConsumerMetrics(), log=structlog.get_logger("tests"), sleep=lambda s: None,
        on_settled=lambda records: None, batch_size=batch_size)
    records = [make_record(value={"n": n}, offset=n) for n in range(60)]
    unavailable: list[str] = []
    try:
        with psycopg.connect(pooled, prepare_threshold=None) as other:
            for i in range(0, 60, 10):
                if (i // 10) % 2:
                    other.execute("SELECT 1")
                try:
                    result = processor.process(records[i:i + 10])
                except DatabaseUnavailable as exc:  # the consumer's loop retries after a back-off
                    unavailable.append(str(exc))
                    result = processor.process(records[i:i + 10])
                assert (result.applied, result.handler_errors) == (10, 0), result
                if (i // 10) % 2:
                    other.commit()
                processor.process(records[i:i + 1])  # a redelivery: lookups from now on
    finally:
        store.close()
    with psycopg.connect(outbox_db, autocommit=True) as direct:
        assert direct.execute("SELECT count(*), count(DISTINCT n) FROM pooled_handler_effects").fetchone() == (60, 60)
        assert direct.execute("SELECT count(DISTINCT server) FROM pooled_handler_effects").fetchone()[0] > 1
    assert len(unavailable) == 1 and "automatic preparing is off" in unavailable[0], unavailable
    assert store._auto_prepare is False  # noqa: SLF001


def test_a_chain_of_statements_transactions_behind_a_transaction_pooler_applies_each_event_once(
        outbox_db, pgbouncer):
    """One at a time, a statements handler's transactions are chained (sent ahead of their
    answers, each committing only when the one before it did, by a session setting).  Behind
    a transaction pooler that gives each transaction another server, the setting does not
    follow them: a chained transaction then fails, goes the usual way, and the store stops
    chaining (PgBouncer may also keep a burst of pipelined transactions on one server, and
    move only between chains: then chaining stays on).  Either way each event is applied
    once, in order."""
    from consumer_sdk.errors import DatabaseUnavailable
    from consumer_sdk.model import BatchResult
    from consumer_sdk.testing import make_record

    pooled = pgbouncer("transaction", pool_size=2, round_robin=True)
    store, processor, settled = _statements_processor(outbox_db, pooled, consumer="pooled-chain",
                                                      table="pooled_chain_effects")
    records = [make_record(value={"n": n}, offset=n) for n in range(200)]
    _open_servers(pooled, 2)

    def settle(batch: list) -> int:
        """As the consumer's loop: what a lost prepared statement left unsettled goes again.
        Returns how many were applied, over every try (process() adds to ``total``)."""
        total = BatchResult()
        for _ in range(5):
            done = len(settled)
            try:
                processor.process(batch, total)
            except DatabaseUnavailable as exc:
                unavailable.append(str(exc))
                batch = batch[len(settled) - done:]
                continue
            return total.applied
        raise AssertionError(unavailable)

    unavailable: list[str] = []
    try:
        applied = settle(records)
        settle(records)
    finally:
        store.close()
    assert applied == len(records) and settled == records + records
    # The redelivery went the usual way, chaining off: the store's own claim, prepared by psycopg
    # after five runs, was lost too, which is retried (at most once: preparing is off after it).
    assert len(unavailable) <= 1 and all("automatic preparing is off" in u for u in unavailable), unavailable
    with psycopg.connect(outbox_db, autocommit=True) as direct:
        assert [n for (n,) in direct.execute("SELECT n FROM pooled_chain_effects ORDER BY seq")] == list(range(200))
        assert direct.execute("SELECT count(DISTINCT server) FROM pooled_chain_effects").fetchone()[0] > 1


def _statements_processor(outbox_db: str, pooled: str, *, consumer: str, table: str) -> tuple[Any, Any, list[Any]]:
    """A one-at-a-time Processor on a PgInboxStore reached through ``pooled``, whose statements
    handler inserts each message's ``n`` into a new ``table`` (``seq`` the insert order,
    ``server`` the server process it ran on); returns (store, processor, settled records)."""
    import structlog

    from consumer_sdk.metrics import ConsumerMetrics
    from consumer_sdk.processor import Policies, Processor
    from consumer_sdk.store import PgInboxStore, connect_factory
    from consumer_sdk.testing import FakeDeadLetters
    from tests.integration.sdk._support import migrate_sdk_db

    migrate_sdk_db(outbox_db)
    with psycopg.connect(outbox_db, autocommit=True) as direct:
        direct.execute(sql.SQL("CREATE TABLE {} (seq bigserial, n int, server int NOT NULL DEFAULT pg_backend_pid())")
                       .format(sql.Identifier(table)))
    insert = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(sql.Identifier(table))
    store = PgInboxStore(connect_factory(pooled))
    settled: list[Any] = []
    processor = Processor(
        consumer=consumer, store=store, handler=None, dead_letters=FakeDeadLetters(), policies=Policies(),
        statements=lambda m: [(insert, (m.json()["n"],))],
        metrics=ConsumerMetrics(), log=structlog.get_logger("tests"), sleep=lambda s: None,
        on_settled=settled.extend, batch_size=1)
    return store, processor, settled


def _open_servers(pooled: str, count: int) -> None:
    """Make PgBouncer open ``count`` server connections: as many transactions at once."""
    conns = [psycopg.connect(pooled, autocommit=True) for _ in range(count)]
    try:
        pids = set()
        for conn in conns:
            conn.execute("BEGIN")
            pids.add(conn.execute("SELECT pg_backend_pid()").fetchone())
        assert len(pids) == count
        for conn in conns:  # ended, not dropped: a server left in a transaction is closed
            conn.execute("COMMIT")
    finally:
        for conn in conns:
            conn.close()


def _wait_succeeded(pool: Any, jobs: int, timeout_s: float = 60.0) -> None:
    """Until ``jobs`` jobs of ``pool`` succeeded, or ``timeout_s`` (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while pool.outcomes["succeeded"] < jobs and time.monotonic() < deadline:
        time.sleep(0.05)  # noqa: TID251 - waiting on the pool's own threads


def _idle_timeouts_seen_through(pooled: str) -> set[str]:
    """idle_in_transaction_session_timeout as a second client of the pooler sees it, over
    enough transactions to visit every server session (psycopg's preparing off: its names
    would not survive the pooler either)."""
    with psycopg.connect(pooled, autocommit=True, prepare_threshold=None) as other_client:
        return {other_client.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0]  # type: ignore[index]
                for _ in range(12)}


@pytest.mark.parametrize("write", ["fenced_execute", "fenced_transaction"])
def test_a_worker_pool_behind_a_transaction_pooler_runs_every_job_once(outbox_db, pgbouncer, write):
    """The whole WorkerPool through PgBouncer in transaction mode, with the pooler giving each
    transaction the server idle longest: claims, heartbeats, fenced writes and completions
    land on whichever server a transaction borrows.  Every job succeeds once and writes its
    effect once; the pool's LISTEN wake-ups (a session feature) need not arrive: the poll
    interval is the net."""
    from consumer_sdk.jobs import JobContext, NewJob, WorkerConfig, WorkerPool, enqueue

    with psycopg.connect(outbox_db, autocommit=True) as direct:
        direct.execute("CREATE TABLE pooled_job_effects (job_id bigint, token bigint, "
                       "server int NOT NULL DEFAULT pg_backend_pid())")
        enqueue(direct, [NewJob(owner_id=f"o{i % 5}", queue="interactive", kind="work", payload={"i": i})
                         for i in range(200)])
    pooled = pgbouncer("transaction", pool_size=3, round_robin=True)
    _open_servers(pooled, 3)
    insert = "INSERT INTO pooled_job_effects (job_id, token) VALUES (%s, %s)"

    def handler(ctx: JobContext) -> None:
        if write == "fenced_execute":
            ctx.fenced_execute(insert, (ctx.job.id, ctx.job.token))
        else:
            with ctx.fenced_transaction() as conn:
                conn.execute(insert, (ctx.job.id, ctx.job.token))

    pool = WorkerPool(WorkerConfig(dsn=pooled, queues=["interactive"], max_concurrency=4,
                                   poll_interval_s=0.2), {"work": handler})
    pool.start()
    try:
        _wait_succeeded(pool, 200)
    finally:
        pool.stop()
    assert pool.outcomes["succeeded"] == 200, dict(pool.outcomes)
    with psycopg.connect(outbox_db, autocommit=True) as direct:
        assert direct.execute("SELECT count(*), count(DISTINCT job_id) FROM pooled_job_effects").fetchone() == (200, 200)
        assert direct.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone() == (200,)
        assert direct.execute("SELECT count(DISTINCT server) FROM pooled_job_effects").fetchone()[0] > 1
    # The pool's session setting (idle_in_transaction_session_timeout) would have stayed on
    # whichever shared server session its connections' first transaction borrowed, for every
    # other client of the pooler: behind a transaction pooler the pool sets none.
    assert _idle_timeouts_seen_through(pooled) == {"0"}


def test_a_worker_pool_started_before_its_pooler_answers_probes_it_when_it_does(outbox_db, db_dsn, pgbouncer):
    """WorkerPool.start() probes for a transaction pooler; when nothing answers yet (the
    pooler not up, the database restarting) the probe failed and psycopg's automatic
    preparing stayed on for good: through PgBouncer the pool then failed as if never
    probed (a statement prepared on one server missing on the next).  Now the first
    connection made once the database answers probes again, before it is used."""
    from consumer_sdk.jobs import JobContext, NewJob, WorkerConfig, WorkerPool, enqueue

    with psycopg.connect(outbox_db, autocommit=True) as direct:
        direct.execute("CREATE TABLE pooled_job_effects (job_id bigint, token bigint)")
        enqueue(direct, [NewJob(owner_id=f"o{i % 5}", queue="interactive", kind="work", payload={"i": i})
                         for i in range(200)])
    port = free_port()
    pooled = make_conninfo(db_dsn, host="127.0.0.1", port=str(port))

    def handler(ctx: JobContext) -> None:
        with ctx.fenced_transaction() as conn:
            conn.execute("INSERT INTO pooled_job_effects (job_id, token) VALUES (%s, %s)",
                         (ctx.job.id, ctx.job.token))

    pool = WorkerPool(WorkerConfig(dsn=pooled, queues=["interactive"], max_concurrency=4,
                                   poll_interval_s=0.2), {"work": handler})
    pool.start()  # nothing listens on the pooler's port yet: the probe fails
    try:
        time.sleep(0.5)  # noqa: TID251 - the pool's threads retry their connections meanwhile
        assert pool.outcomes["succeeded"] == 0
        assert pgbouncer("transaction", pool_size=3, round_robin=True, port=port) == pooled
        _wait_succeeded(pool, 200)
    finally:
        pool.stop()
    assert pool.outcomes["succeeded"] == 200, dict(pool.outcomes)
    with psycopg.connect(outbox_db, autocommit=True) as direct:
        assert direct.execute("SELECT count(*), count(DISTINCT job_id) FROM pooled_job_effects").fetchone() == (200, 200)
    assert _idle_timeouts_seen_through(pooled) == {"0"}


def test_the_inbox_store_finds_a_transaction_pooler_and_stops_psycopgs_preparing(outbox_db, pgbouncer):
    """InboxConsumer.start() probes (PgInboxStore.probe_pooler): behind a transaction pooler
    psycopg's per-connection statement names could be missing on the next server, or name
    another client's statement there, so its automatic preparing is off from the start.
    Directly connected, and behind a session pooler, it stays on."""
    from consumer_sdk.store import PgInboxStore, connect_factory

    for dsn, pooled in ((pgbouncer("transaction"), True), (pgbouncer("session"), False), (outbox_db, False)):
        store = PgInboxStore(connect_factory(dsn))
        try:
            assert store.probe_pooler() is pooled, dsn
            assert (store.conn.prepare_threshold is None) is pooled
        finally:
            store.close()
