"""`migrate` racing `migrate`: two deploys (or a deploy and an operator) starting it against
the same database at once.  The first one holds the run lock for its whole run; the other
waits, then finds the work done, or says in one line why it cannot do what it was asked.

Before: each migration took the lock on its own and the list of applied migrations was
read once, unlocked, at the start.  Both runs applied the same files, and a plain
`migrate` racing `migrate --partitioned` applied the plain variant of 0015 to the
partitioned outbox the other had made: a traceback (an audit of the relay's operation,
/work/opslab/t_concurrent_migrate.py)."""

from __future__ import annotations

import os
import subprocess
import threading
from typing import Any

import psycopg
import pytest

from relay import migrate
from tests.fixtures.outbox import relay_cmd
from tests.fixtures.procs import wait_until

ALL = [m.path.name for m in migrate.migrations()]
ALL_PARTITIONED = [m.path.name for m in migrate.migrations(partitioned=True)]


class _PausingLog:
    """A log that holds its migrate run up after its first migration is applied (the run
    lock held), until the test lets it go: the other migrate starts in that window."""

    def __init__(self) -> None:
        self.paused = threading.Event()
        self.go_on = threading.Event()

    def info(self, event: str, **_: Any) -> None:
        if event == "migration_applied" and not self.paused.is_set():
            self.paused.set()
            assert self.go_on.wait(60), "the test never let the first migrate go on"

    def warning(self, event: str, **_: Any) -> None:
        pass


class _Run(threading.Thread):
    def __init__(self, dsn: str, *, partitioned: bool, log: Any = None) -> None:
        super().__init__(daemon=True)
        self.dsn, self.partitioned, self.log = dsn, partitioned, log
        self.applied: list[str] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.applied = migrate.apply(self.dsn, partitioned=self.partitioned, log=self.log)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc


#: Two migrates' run-lock holders: the first's, which took it, and the second's, which tries it
#: again every quarter second (relay/migrate.py, _hold_run_lock), each in its transaction.
RUN_LOCK_HOLDERS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'outbox-relay-migrate'
  AND query LIKE '%%outbox-relay-migrate-run%%'
  AND now() - xact_start > make_interval(secs => %(waited_s)s)
"""


def _waiting_for_the_run_lock(dsn: str, waited_s: float = 0.0) -> bool:
    """A second migrate has been waiting for the first's run lock for ``waited_s``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(RUN_LOCK_HOLDERS, {"waited_s": waited_s}).fetchone()
    return bool(row and row[0] >= 2)


def _first_paused(dsn: str, *, partitioned: bool) -> tuple[_Run, _PausingLog]:
    log = _PausingLog()
    first = _Run(dsn, partitioned=partitioned, log=log)
    first.start()
    wait_until(lambda: log.paused.is_set() or not first.is_alive(), 60, message="first migrate never paused")
    assert first.error is None, first.error
    return first, log


def _partitioned(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_partitioned_table "
                           "WHERE partrelid = 'outbox'::regclass)").fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("first_partitioned", [False, True])
def test_a_second_migrate_waits_for_the_first_and_finds_the_work_done(db_dsn, first_partitioned):
    """Before: the second applied the migrations the first had not reached yet (both said
    they applied them); with --partitioned first, the plain one applied 0015's plain
    variant to the partitioned outbox: WrongObjectType."""
    first, log = _first_paused(db_dsn, partitioned=first_partitioned)
    second = _Run(db_dsn, partitioned=False)
    second.start()
    wait_until(lambda: not second.is_alive() or _waiting_for_the_run_lock(db_dsn), 30,
               message="the second migrate neither waited nor ended")
    log.go_on.set()
    first.join(60)
    second.join(60)
    assert first.error is None and second.error is None, (first.error, second.error)
    assert first.applied == (ALL_PARTITIONED if first_partitioned else ALL)
    assert second.applied == []
    assert _partitioned(db_dsn) is first_partitioned


def test_migrate_partitioned_after_a_plain_one_won_the_race_says_so_in_one_line(db_dsn):
    first, log = _first_paused(db_dsn, partitioned=False)
    loser = subprocess.Popen(relay_cmd("migrate", "--partitioned"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "OUTBOX_RELAY_DSN": db_dsn,
                                             "OUTBOX_RELAY_LOG_FORMAT": "json"})
    try:
        wait_until(lambda: loser.poll() is not None or _waiting_for_the_run_lock(db_dsn), 30,
                   message="the second migrate neither waited nor ended")
    finally:
        log.go_on.set()
    out, err = loser.communicate(timeout=60)
    first.join(60)
    assert first.error is None and first.applied == ALL
    assert loser.returncode == 2, (out, err)
    assert "Traceback" not in out + err
    [line] = err.strip().splitlines()
    assert "already exists as a plain table" in line and "--partitioned needs a database without an outbox" in line
    assert not _partitioned(db_dsn)


@pytest.mark.parametrize("second", [["migrate"], ["migrate", "--partitioned"]])
def test_two_migrate_processes_started_together_on_a_fresh_database(db_dsn, second):
    """The audit's reproduction: two processes at once, whoever wins.  Neither prints a
    traceback; a plain migrate against a partitioned winner finds the work done, a
    partitioned one against a plain winner is refused with exit 2."""
    env = {**os.environ, "OUTBOX_RELAY_DSN": db_dsn, "OUTBOX_RELAY_LOG_FORMAT": "json"}
    procs = [subprocess.Popen(relay_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for args in (["migrate", "--partitioned"], second)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert "Traceback" not in out + err
        assert p.returncode in (0, 2), (out, err)
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM outbox_schema_migrations ORDER BY version")]
    assert versions == [m.version for m in migrate.migrations()]
    if second == ["migrate", "--partitioned"]:
        assert codes == [0, 0] and _partitioned(db_dsn)
    elif codes == [0, 2]:  # the plain one won: the partitioned one was refused
        assert not _partitioned(db_dsn)


def test_a_second_migrate_process_waits_and_says_the_schema_is_at_its_level(db_dsn):
    first, log = _first_paused(db_dsn, partitioned=False)
    second = subprocess.Popen(relay_cmd("migrate"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OUTBOX_RELAY_DSN": db_dsn, "OUTBOX_RELAY_LOG_FORMAT": "json"})
    try:
        wait_until(lambda: second.poll() is not None or _waiting_for_the_run_lock(db_dsn), 30,
                   message="the second migrate neither waited nor ended")
    finally:
        log.go_on.set()
    out, err = second.communicate(timeout=60)
    first.join(60)
    assert first.error is None and first.applied == ALL
    assert second.returncode == 0, (out, err)
    assert '"event": "migration_waiting"' in out + err
    level = migrate.migrations()[-1].version
    assert f"migrations applied: none (schema up to date: level {level})" in out
