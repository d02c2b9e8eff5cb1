"""outbox_core.spin on a real PostgreSQL: a spinning connection answers as psycopg's own
does, polls for the answers that come within its budget, and stops polling when they
keep coming later; the SDK's connections are such connections when configured so."""

from __future__ import annotations

import psycopg
import pytest

from consumer_sdk.config import InboxConfig
from consumer_sdk.errors import ConfigError
from consumer_sdk.jobs.config import WorkerConfig
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.store import connect_factory
from outbox_core import spin
from outbox_core.spin import MISSES_BEFORE_PAUSE, SpinningConnection


def test_answers_within_the_budget_are_polled_for_and_right(db_dsn: str) -> None:
    # A budget far above a local round trip: every answer should come while polling.
    with spin.connect(db_dsn, spin_s=0.2, autocommit=True) as conn:
        assert isinstance(conn, SpinningConnection)
        assert conn.spinner is not None
        for n in range(50):
            assert conn.execute("SELECT %s::int + 1", (n,)).fetchone() == (n + 1,)
        rows = conn.execute("SELECT g, repeat('x', 20000) FROM generate_series(1, 200) g").fetchall()
        assert [r[0] for r in rows] == list(range(1, 201)) and all(len(r[1]) == 20000 for r in rows)
        assert conn.spinner.hits >= 50
        assert conn.spinner.misses == 0


def test_transactions_pipelines_and_errors_behave_as_psycopg_s(db_dsn: str) -> None:
    with spin.connect(db_dsn, spin_s=0.2) as conn:  # not autocommit: psycopg's own BEGIN
        conn.execute("CREATE TABLE spun (n int PRIMARY KEY)")
        conn.commit()
        with conn.transaction():
            conn.execute("INSERT INTO spun VALUES (1), (2)")
        with conn.pipeline():
            conn.execute("INSERT INTO spun VALUES (3)")
            cur = conn.execute("SELECT count(*) FROM spun")
        assert cur.fetchone() == (3,)
        conn.commit()
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("INSERT INTO spun VALUES (1)")
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM spun").fetchone() == (3,)
        conn.commit()


def test_answers_later_than_the_budget_pause_the_polling(db_dsn: str) -> None:
    with spin.connect(db_dsn, spin_s=50e-6, autocommit=True) as conn:
        assert conn.spinner is not None
        for _ in range(MISSES_BEFORE_PAUSE):
            conn.execute("SELECT pg_sleep(0.02)")  # 20 ms: far past a 50 µs budget
        assert conn.spinner.misses >= MISSES_BEFORE_PAUSE
        misses = conn.spinner.misses
        for _ in range(5):
            row = conn.execute("SELECT pg_sleep(0.005), 7").fetchone()
            assert row is not None and row[1] == 7
        assert conn.spinner.skipped >= 5  # slept at once, no budget spent
        assert conn.spinner.misses == misses


def test_a_connection_killed_under_a_wait_raises_as_psycopg_s_does(db_dsn: str) -> None:
    with spin.connect(db_dsn, spin_s=0.001, autocommit=True) as conn, \
            psycopg.connect(db_dsn, autocommit=True) as admin:
        pid = conn.info.backend_pid
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
        assert conn.broken or conn.closed


def test_without_select_poll_or_psycopg_s_wait_it_is_a_plain_connection(
        db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spin, "AVAILABLE", False)
    with spin.connect(db_dsn, spin_s=100e-6, autocommit=True) as conn:
        assert type(conn) is psycopg.Connection
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_zero_budget_is_a_plain_connection(db_dsn: str) -> None:
    with spin.connect(db_dsn, spin_s=0.0, autocommit=True) as conn:
        assert type(conn) is psycopg.Connection
    with connect_factory(db_dsn, spin_s=0.0)() as conn:
        assert type(conn) is psycopg.Connection
    with connect_factory(db_dsn, spin_s=100e-6)() as conn:
        assert isinstance(conn, SpinningConnection) and conn.spinner is not None
        assert conn.spinner.budget_s == pytest.approx(100e-6)


@pytest.mark.parametrize("value", [-1.0, 10_001.0, float("nan")])
def test_the_configs_refuse_a_budget_out_of_range(value: float) -> None:
    with pytest.raises(ConfigError, match="db_spin_us"):
        InboxConfig(name="x", bootstrap_servers="localhost:9092", topics=["t"], db_spin_us=value)
    with pytest.raises(InvalidJob, match="db_spin_us"):
        WorkerConfig(dsn="postgresql://localhost/x", db_spin_us=value)


def test_the_consumer_s_connection_polls_as_its_config_says(db_dsn: str) -> None:
    import dataclasses

    from consumer_sdk import InboxConsumer

    config = InboxConfig(name="spin", dsn=db_dsn, bootstrap_servers="localhost:1", topics=["t"])
    polling = InboxConsumer(config, lambda conn, message: None)
    sleeping = InboxConsumer(dataclasses.replace(config, db_spin_us=0), lambda conn, message: None)
    try:
        conn = polling.store.conn  # the connection a handler is given
        assert isinstance(conn, SpinningConnection) and conn.spinner is not None
        assert conn.spinner.budget_s == pytest.approx(100e-6)
        assert type(sleeping.store.conn) is psycopg.Connection
    finally:
        polling.store.conn.close()
        sleeping.store.conn.close()
