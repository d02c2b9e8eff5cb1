"""Operators' side: retention of finished runs, jobs and activations (bounded batches), the CLI."""

from __future__ import annotations

import io
import json

import pytest

from consumer_sdk.jobs import (
    JobsMetrics,
    NewJob,
    Reconciler,
    WaitFor,
    WorkerConfig,
    WorkerPool,
    accept,
    activate,
    enqueue,
    waits,
)
from consumer_sdk.jobs import cli as jobs_cli
from consumer_sdk.jobs import queue as jobq
from consumer_sdk.jobs.admin import cleanup, dead_letters
from tests.integration.jobs._support import at, claim_next, scalar

DAY_S = 86400.0


def test_cleanup_deletes_what_ended_long_ago_and_keeps_the_rest(conn, jobs_db):
    done = accept(conn, owner_id="o", request_key="done", kind="k", body={}, now=at(0))
    failed = accept(conn, owner_id="o", request_key="failed", kind="k", body={}, now=at(0))
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={})], now=at(0))
    waiting = accept(conn, owner_id="o", request_key="waiting", kind="k", body={}, now=at(0))
    for job in claim_next(conn, "A", now=at(1), max_concurrency=4):
        if job.run_id == done.run_id or job.run_id is None:
            assert jobq.complete(conn, job.lease, result=1, now=at(2))
        elif job.run_id == failed.run_id:
            assert jobq.fail(conn, job.lease, reason="permanent_error", error="E: x", error_type="E", now=at(2))
        else:
            assert waits.park(conn, job.lease, WaitFor("key-1", "x"), now=at(2)) == "waiting"
    activate(conn, "old-unused", None, now=at(0))

    assert cleanup(conn, older_than_s=DAY_S, now=at(DAY_S / 2)) == (0, 0)  # nothing old enough
    assert cleanup(conn, older_than_s=DAY_S, now=at(2 * DAY_S), batch=1) == (2, 1)
    assert scalar(jobs_db, "SELECT array_agg(request_key ORDER BY request_key) FROM runs") == [
        "failed", "waiting"]  # a failed job stays while its dead letter does
    assert len(dead_letters(conn)) == 1 and waiting.created
    assert scalar(jobs_db, "SELECT count(*) FROM job_activations") == 0


def test_cli_reports_runs_reconciles_and_cleans(conn):
    run = accept(conn, owner_id="o", request_key="r", kind="k", body={"a": 1})
    out = io.StringIO()
    assert jobs_cli.main(["runs", "show", str(run.run_id), "--dsn", conn.info.dsn], out=out) == 0
    assert json.loads(out.getvalue())["status"] == "queued"
    out = io.StringIO()
    assert jobs_cli.main(["reconcile", "--dsn", conn.info.dsn], out=out) == 0
    stats = json.loads(out.getvalue())["stats"]
    assert {s["queue"]: s["ready"] for s in stats} == {"interactive": 1, "bulk": 0}
    out = io.StringIO()
    assert jobs_cli.main(["cleanup", "--older-than-days", "30", "--dsn", conn.info.dsn], out=out) == 0
    assert json.loads(out.getvalue()) == {"runs_and_jobs_deleted": 0, "activations_deleted": 0}
    assert jobs_cli.main(["dead-letters", "show", "999", "--dsn", conn.info.dsn], out=io.StringIO()) == 1
    assert jobs_cli.main(["dead-letters", "list"], out=io.StringIO()) == 2  # no DSN


def test_cli_reconciles_a_services_own_queue_and_every_queue_with_jobs_by_default(conn):
    """Queues are any valid name; `reconcile --queues reports.nightly` was refused (exit 2:
    "the queues are interactive and bulk") and the default reported those two only."""
    enqueue(conn, [NewJob(owner_id="o", queue="reports.nightly", kind="k", payload={}) for _ in range(2)])
    out = io.StringIO()
    assert jobs_cli.main(["reconcile", "--queues", "reports.nightly", "--dsn", conn.info.dsn], out=out, env={}) == 0
    assert [s["queue"] for s in json.loads(out.getvalue())["stats"]] == ["reports.nightly"]
    out = io.StringIO()
    assert jobs_cli.main(["reconcile", "--dsn", conn.info.dsn], out=out, env={}) == 0
    stats = {s["queue"]: s for s in json.loads(out.getvalue())["stats"]}
    assert set(stats) == {"bulk", "interactive", "reports.nightly"}
    assert stats["reports.nightly"]["ready"] == 2


def test_the_reconciler_exports_the_queue_gauges(conn):
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={}) for _ in range(3)], now=at(0))
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={}, delay_s=60)], now=at(0))
    metrics = JobsMetrics()
    Reconciler(queues=["interactive", "bulk"], metrics=metrics, db_now=lambda: at(42)).run_once(conn)
    sample = metrics.registry.get_sample_value
    assert sample("outbox_jobs_oldest_pending_age_seconds", {"queue": "bulk"}) == 42.0
    assert sample("outbox_jobs_pending", {"queue": "bulk"}) == 3  # the delayed one is not due
    assert sample("outbox_jobs_oldest_pending_age_seconds", {"queue": "interactive"}) == 0.0


@pytest.mark.parametrize("args", [["runs", "show", "run-\udcff"], ["dead-letters", "list", "--queue", "\udcff"]])
def test_cli_refuses_arguments_that_are_not_utf8(conn, args, capsys):
    """Bytes that are not UTF-8 reached psycopg as lone surrogates: a UnicodeEncodeError
    traceback from the query's parameters."""
    assert jobs_cli.main([*args, "--dsn", conn.info.dsn], out=io.StringIO(), env={}) == 2
    assert "is not valid UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "code", "err"), [
    # The database refused these with "bigint out of range", "invalid input syntax for type
    # uuid" and "interval out of range" (exit 1); now the CLI does, exit 2, before connecting.
    (["dead-letters", "list", "--limit", "99999999999999999999"], 2, "argument --limit: must be from 1 to 10000"),
    (["dead-letters", "show", "99999999999999999999"], 2, "argument JOB_ID: must be a job id from 1 to"),
    (["runs", "show", "not-a-uuid"], 2, "argument RUN_ID: not a run id"),
    # Python's uuid.UUID reads a "urn:uuid:" prefix; PostgreSQL's uuid input refused it.
    (["runs", "show", "urn:uuid:123e4567-e89b-12d3-a456-426614174000"], 2, "argument RUN_ID: not a run id"),
    # Braces and capitals PostgreSQL reads as the same run id.
    (["runs", "show", "{123E4567-E89B-12D3-A456-426614174000}"], 1, "no run 123e4567-e89b-12d3-a456-426614174000"),
    (["cleanup", "--older-than-days", "1e10"], 2, "argument --older-than-days: must be a number of days"),
    # Not found: on stderr (it was on stdout), exit 1.
    (["runs", "show", "123e4567-e89b-12d3-a456-426614174000"], 1, "no run 123e4567-e89b-12d3-a456-426614174000"),
    (["dead-letters", "show", "999"], 1, "job 999 has no dead letter"),
    (["dead-letters", "requeue", "999"], 1, "job 999 has no dead letter"),
])
def test_cli_bad_input_and_not_found_against_a_database(conn, args, code, err, capsys):
    out = io.StringIO()
    try:
        got = jobs_cli.main([*args, "--dsn", conn.info.dsn], out=out, env={})
    except SystemExit as exc:
        got = exc.code
    captured = capsys.readouterr()
    assert got == code
    assert out.getvalue() == "" and captured.out == ""
    assert err in captured.err and captured.err.count("\n") == 1


def test_cli_output_is_clean_for_scripts_and_terminals(conn):
    """Found by an audit of the pool: `reconcile` printed its reaper's log line on stdout
    before the JSON, and `dead-letters list` printed a handler's error as it was, control
    characters and all (ESC [2J cleared the operator's terminal)."""
    import subprocess
    import sys

    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={}, max_attempts=1)])
    (job,) = claim_next(conn, "gone-worker", now=None, lease_s=0.05)
    conn.execute("SELECT pg_sleep(0.1)")  # its lease expires: the reconciler reaps it
    run = subprocess.run([sys.executable, "-m", "consumer_sdk.jobs", "reconcile", "--dsn", conn.info.dsn],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["failed_expired"] == 1  # stdout is the JSON alone
    assert "leases_expired" in run.stderr
    conn.execute("UPDATE job_dead_letters SET error = %s WHERE job_id = %s",
                 ("boom\n\x1b[2J\x1b[31mFAKE: all good\x1b[0m\r\x07", job.id))
    shown = subprocess.run([sys.executable, "-m", "consumer_sdk.jobs", "dead-letters", "list", "--dsn",
                            conn.info.dsn], capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\r" not in shown.stdout and "\x07" not in shown.stdout
    assert "boom\n            \\u001b[2J\\u001b[31mFAKE: all good\\u001b[0m\\u000d\\u0007" in shown.stdout


def _expire(conn, job_id: int) -> None:
    conn.execute("UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s", (job_id,))


def test_cli_reconcile_writes_the_events_the_pools_write(conn, jobs_db):
    """`reconcile` failed a job whose lease expired on its last attempt without the job.failed
    event a pool's own pass writes with its WorkerConfig.events_topic: the outbox stayed empty
    (an audit of the pool).  Given the same topic (--events-topic, or OUTBOX_JOBS_EVENTS_TOPIC),
    it writes the same event; and a parked job it resumes gets its job.resumed."""
    ids = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="x", payload={}, max_attempts=1)
                         for _ in range(3)])
    assert len(claim_next(conn, "A", now=None, queues=("bulk",), lease_s=60, max_concurrency=3)) == 3
    topic = "jobs.events"
    _expire(conn, ids[0])
    assert jobs_cli.main(["reconcile", "--queues", "bulk", "--events-topic", topic, "--dsn", jobs_db],
                         out=io.StringIO(), env={}) == 0
    _expire(conn, ids[1])
    out = io.StringIO()
    assert jobs_cli.main(["reconcile", "--dsn", jobs_db], out=out, env={"OUTBOX_JOBS_EVENTS_TOPIC": topic}) == 0
    assert json.loads(out.getvalue())["failed_expired"] == 1
    _expire(conn, ids[2])  # a pool's own pass, with that topic in its config
    pool = WorkerPool(WorkerConfig(dsn=jobs_db, events_topic=topic, listen=False), {"x": lambda ctx: None})
    assert pool.reconciler.run_once(conn).failed_expired == 1

    events = conn.execute("SELECT topic, key, payload, headers FROM outbox ORDER BY id").fetchall()
    assert [(t, key, p["type"], p["job_id"]) for t, key, p, _h in events] == \
        [(topic, f"job-{i}", "job.failed", i) for i in ids]
    shapes = {json.dumps({**p, "job_id": None}, sort_keys=True) + json.dumps(h, sort_keys=True)
              for _t, _k, p, h in events}
    assert len(shapes) == 1, shapes  # the CLI's events are the pool's, but for the job

    waiting = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="w", payload={})])[0]
    (job,) = claim_next(conn, "A", now=None, queues=("bulk",), lease_s=60)
    assert waits.park(conn, job.lease, WaitFor(key="approval:1", cause="approval")) == "waiting"
    conn.execute("INSERT INTO job_activations (key, payload) VALUES ('approval:1', '{}')")  # its wake-up lost
    assert jobs_cli.main(["reconcile", "--events-topic", topic, "--dsn", jobs_db], out=io.StringIO(), env={}) == 0
    assert conn.execute("SELECT payload->>'type' FROM outbox WHERE payload->>'job_id' = %s",
                        (str(waiting),)).fetchall() == [("job.resumed",)]
