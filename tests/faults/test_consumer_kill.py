"""The dedup consumer SIGKILLed again and again while 10,000 events flow: every effect
exists exactly once afterwards, and nothing is missing.

Kills come two ways: from outside, when the effects reach a random count (anywhere in
the loop: polling, inside the handler, inside a commit), and from the consumer itself,
right after a database commit and before the Kafka offset commit (the window where only
the inbox prevents a double apply).  Each process applies through a handler or through a
statements handler (issue 19: the inbox row, the statements and COMMIT in one round trip),
at random."""

from __future__ import annotations

import random
import sys
import uuid
from pathlib import Path

import psycopg

from tests.fixtures.broker import create_topic
from tests.fixtures.outbox import RelayThread
from tests.fixtures.procs import Proc, wait_until
from tests.integration.sdk._support import counter, effect_counts, migrate_sdk_db, write_numbered

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("_consumer_proc.py")
TOTAL = 10_000
CHUNK = 1_000
MIN_KILLS = 20


def _effect_rows(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM effects").fetchone()
    return int(row[0]) if row else 0


def test_sigkill_between_db_commit_and_offset_commit_many_times(db_dsn, broker, topic_name, spawn):
    rng = random.Random(7)
    dsn = migrate_sdk_db(db_dsn)
    topic = topic_name("kill")
    create_topic(broker.bootstrap, topic, partitions=3)
    create_topic(broker.bootstrap, f"{topic}.dlq", partitions=1)  # Apache Kafka does not auto-create it
    name = f"killed-{uuid.uuid4().hex[:6]}"
    written: list[str] = write_numbered(dsn, topic, 2 * CHUNK)

    def start(kill_probability: float) -> Proc:
        cmd = [sys.executable, str(RUNNER), "--dsn", dsn, "--bootstrap", broker.bootstrap, "--topic", topic,
               "--name", name, "--batch-size", str(rng.choice([1, 10, 100])),
               "--kill-probability", str(kill_probability), "--seed", str(rng.randrange(1 << 30)),
               *rng.choice([[], ["--statements"]])]  # a handler, or a statements handler (one round trip)
        return spawn(cmd, env={"PYTHONPATH": str(ROOT)}, name="consumer", cwd=ROOT)

    outside_kills = self_kills = 0
    procs: list[Proc] = []
    with RelayThread(dsn, broker.bootstrap, batch_size=500):
        while outside_kills + self_kills < MIN_KILLS or _effect_rows(dsn) < TOTAL - 500:
            proc = start(kill_probability=0.04)
            procs.append(proc)
            target = min(_effect_rows(dsn) + rng.randrange(50, 800), TOTAL - 200)
            wait_until(lambda: not proc.alive or _effect_rows(dsn) >= target, timeout_s=30,  # noqa: B023
                       message=lambda: f"no progress: {_effect_rows(dsn)} rows, log:\n{proc.log_tail()}")  # noqa: B023
            if proc.alive:
                proc.sigkill()
                outside_kills += 1
            else:
                assert proc.returncode == -9, proc.log_tail()
                self_kills += 1
            if len(written) < TOTAL:  # events keep flowing in while the consumer dies
                written += write_numbered(dsn, topic, CHUNK, start=len(written))

        final = start(kill_probability=0.0)
        procs.append(final)
        # Its SIGTERM handler first: the others may have applied everything already, and a
        # SIGTERM during the interpreter's start-up kills it (CI, 2026-12-03: exit -15).
        final.wait_for_log("consumer_process_started", timeout_s=60)
        wait_until(lambda: len(effect_counts(dsn)) >= TOTAL, timeout_s=60,
                   message=lambda: f"{len(effect_counts(dsn))} of {TOTAL} applied; log:\n{final.log_tail()}")
        final.sigterm()
        assert final.wait(30) == 0, final.log_tail()

    effects = effect_counts(dsn)
    duplicated = {event_id: n for event_id, n in effects.items() if n != 1}
    assert duplicated == {}, f"{len(duplicated)} effects applied more than once"
    assert set(effects) == set(written), "effects missing or unknown"
    assert _effect_rows(dsn) == TOTAL
    assert counter(dsn) == TOTAL
    assert outside_kills + self_kills >= MIN_KILLS
    assert self_kills >= 3, "the DB-commit/offset-commit window was not exercised enough"
    with psycopg.connect(dsn, autocommit=True) as conn:
        inbox = conn.execute("SELECT count(*) FROM outbox_inbox WHERE consumer = %s", (name,)).fetchone()
    assert inbox == (TOTAL,)
    # Both ways of applying were killed: a handler's and a statements handler's.
    assert sum("handler=statements" in p.log_text() for p in procs) >= 3
    assert sum("handler=apply" in p.log_text() for p in procs) >= 3
    # Redelivered copies of applied events really came, and were dropped.
    assert sum(p.log_text().count("duplicate_dropped") for p in procs) > 0
