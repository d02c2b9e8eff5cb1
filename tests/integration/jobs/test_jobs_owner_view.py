"""What a run's owner sees of a failure: a stable error class and a reference, never the raw
error text (which can hold internal URLs or tokens); the admin CLI shows the raw text."""

from __future__ import annotations

import io
import json
from typing import Any

from consumer_sdk.jobs import (
    JobContext,
    PermanentJobError,
    TransientJobError,
    accept,
    owner_view,
    run_status,
)
from consumer_sdk.jobs import cli as jobs_cli
from consumer_sdk.jobs.retry import Backoff
from tests.fixtures.procs import wait_until

RAW = "upstream http://billing.internal:8080/v1?token=s3cr3t-t0ken refused"


def _until(conn: Any, run_id: Any, predicate: Any) -> Any:
    return wait_until(lambda: (s := run_status(conn, run_id)) is not None and predicate(s) and s,
                      timeout_s=20, message="the run did not get there")


def test_a_failed_run_shows_its_owner_a_class_and_a_reference_only(conn, pools):
    def broken(ctx: JobContext) -> Any:
        raise PermanentJobError(RAW)

    pools({"broken": broken})
    run = accept(conn, owner_id="o1", request_key="k1", kind="broken", body={})
    state = _until(conn, run.run_id, lambda s: s.status == "failed")
    view = owner_view(state)
    assert "s3cr3t" not in json.dumps(view) and "billing.internal" not in json.dumps(view)
    assert "last_error" not in view
    assert view["error"] == {"class": "permanent_error", "reference": f"err-{state.job_id}-1"}
    out = io.StringIO()
    assert jobs_cli.main(["runs", "show", str(run.run_id), "--dsn", conn.info.dsn], out=out) == 0
    shown = json.loads(out.getvalue())
    assert RAW in shown["last_error"] and shown["error_reference"] == view["error"]["reference"]


def test_a_retrying_run_shows_the_retrying_class(conn, pools):
    def flaky(ctx: JobContext) -> Any:
        raise TransientJobError(RAW)

    pools({"flaky": flaky}, backoff=Backoff(initial_s=30, max_s=30))
    run = accept(conn, owner_id="o1", request_key="k2", kind="flaky", body={}, max_attempts=3)
    state = _until(conn, run.run_id, lambda s: s.status == "queued" and s.attempts >= 1 and s.last_error)
    view = owner_view(state)
    assert "s3cr3t" not in json.dumps(view)
    assert view["error"]["class"] == "retrying"
