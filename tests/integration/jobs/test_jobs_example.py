"""examples/jobs_http.py as a real process: 202 + Location, polling, problem details,
Retry-After when admission refuses, cancellation."""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.fixtures.procs import wait_until

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "jobs_http.py"


def call(base: str, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method,
                                     headers={"X-Owner": "alice", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_the_http_example_accepts_polls_refuses_and_cancels(jobs_db, spawn):
    proc = spawn([sys.executable, str(EXAMPLE), "--port", "0", "--capacity-per-s", "0.1",
                  "--horizon-s", "20"], env={"OUTBOX_DSN": jobs_db}, name="jobs-http")
    base = re.search(r"http://\S+", proc.wait_for_log(re.compile(r"listening on http://\S+"), 30)).group(0)

    status, headers, body = call(base, "POST", "/runs", {"words": 2, "step_s": 0.05}, **{"Idempotency-Key": "a"})
    assert status == 202 and headers["Location"] == body["status_url"] == f"/runs/{body['run_id']}"
    final = wait_until(lambda: (r := call(base, "GET", headers["Location"]))[2]["status"] == "succeeded" and r,
                       timeout_s=20, message="the run never succeeded")
    assert final[2]["result"] == {"words": 2} and "Retry-After" not in final[1]

    again = call(base, "POST", "/runs", {"words": 2, "step_s": 0.05}, **{"Idempotency-Key": "a"})
    assert again[0] == 202 and again[2]["run_id"] == body["run_id"]
    conflict = call(base, "POST", "/runs", {"words": 3}, **{"Idempotency-Key": "a"})
    assert conflict[0] == 409 and conflict[1]["Content-Type"] == "application/problem+json"
    assert conflict[2]["type"].endswith("/idempotency-key-reused") and conflict[2]["status"] == 409

    # Capacity 0.1/s over 20 s: two pending jobs fill the queue; the third is refused.
    slow = [call(base, "POST", "/runs", {"words": 500, "step_s": 0.05}, **{"Idempotency-Key": k})
            for k in ("s1", "s2")]
    assert all(s[0] == 202 for s in slow)
    refused = call(base, "POST", "/runs", {"words": 1}, **{"Idempotency-Key": "s3"})
    assert refused[0] == 503 and int(refused[1]["Retry-After"]) >= 1
    assert refused[2]["type"].endswith("/queue-full") and refused[2]["queue"] == "interactive"

    cancelled = call(base, "DELETE", slow[0][1]["Location"])
    assert cancelled[0] == 200 and cancelled[2]["status"] == "cancelled"
    assert call(base, "GET", slow[1][1]["Location"], **{"X-Owner": "mallory"})[0] == 404
    assert call(base, "DELETE", slow[1][1]["Location"])[2]["status"] == "cancelled"
    assert call(base, "POST", "/runs", {"words": 1})[2]["type"].endswith("/idempotency-key-required")
    proc.sigterm()
    assert proc.wait(20) == 0


def test_the_http_example_runs_on_asyncio_without_threads_for_the_api():
    text = EXAMPLE.read_text()
    assert "from consumer_sdk.jobs import aio as jobs" in text and "asyncio.start_server" in text
    assert "await jobs.accept(" in text and "await jobs.run_status(" in text
