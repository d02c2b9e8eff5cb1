"""Long work over HTTP: accept once (202 + the run's URL), poll its status, a worker in-process.

    OUTBOX_DSN=postgresql://... python examples/jobs_http.py --port 8080   # after `outbox-relay migrate`
    curl -i -X POST localhost:8080/runs -H 'X-Owner: alice' -H 'Idempotency-Key: r1' -d '{"words": 3}'
    curl -i localhost:8080/runs/<run_id> -H 'X-Owner: alice'          # poll until "succeeded"
    curl -i -X DELETE localhost:8080/runs/<run_id> -H 'X-Owner: alice'  # cancel

Errors are RFC 9457 problem details; a full queue answers 503 with Retry-After.  X-Owner
stands in for real authentication.  The browser tab owns nothing: the database does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg

from consumer_sdk.jobs import (
    AdmissionPolicy,
    AdmissionRefused,
    InvalidJob,
    JobContext,
    PermanentJobError,
    RequestKeyConflict,
    RunNotFound,
    WorkerConfig,
    WorkerPool,
    accept,
    cancel_run,
    owner_view,
    run_status,
)

RUN_PATH = re.compile(r"^/runs/([0-9a-f-]{36})$")
MAX_BODY = 64 * 1024
PROBLEMS = "https://example.com/problems/"


def count_words(ctx: JobContext) -> Any:
    """The demo's long work: one step per word, each result written by key (no duplicates)."""
    words = int(ctx.payload.get("words", 1))
    if words < 0:
        raise PermanentJobError("words must be >= 0")  # never retried; dead-lettered
    done = ctx.results()
    for i in range(words):
        if f"word-{i}" not in done:
            ctx.sleep(float(ctx.payload.get("step_s", 0.2)))  # stops at once when cancelled
            ctx.put_result(f"word-{i}", {"word": i})
    return {"words": words}


class Problem(Exception):
    def __init__(self, status: int, slug: str, title: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status, self.headers = status, extra.pop("headers", {})
        self.body = {"type": PROBLEMS + slug, "title": title, "status": status, "detail": detail, **extra}


class Api(BaseHTTPRequestHandler):
    dsn = ""
    admission: AdmissionPolicy | None = None

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(self._create)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(lambda: self._read(cancel=False))

    def do_DELETE(self) -> None:  # noqa: N802
        self._answer(lambda: self._read(cancel=True))

    def _create(self) -> tuple[int, dict[str, Any], dict[str, str]]:
        if self.path != "/runs":
            raise Problem(404, "not-found", "Not Found", f"no resource at {self.path}")
        key = self.headers.get("Idempotency-Key")
        if not key:
            raise Problem(400, "idempotency-key-required", "Idempotency-Key required",
                          "POST /runs needs an Idempotency-Key header so a retried request is not run twice")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            run = accept(conn, owner_id=self._owner(), request_key=key, kind="count_words",
                         body=self._json(), traceparent=self.headers.get("traceparent"),
                         admission=self.admission)
            state = run_status(conn, run.run_id)
        assert state is not None
        location = f"/runs/{run.run_id}"
        return 202, {**owner_view(state), "status_url": location}, {"Location": location}

    def _read(self, *, cancel: bool) -> tuple[int, dict[str, Any], dict[str, str]]:
        match = RUN_PATH.match(self.path)
        if match is None:
            raise Problem(404, "not-found", "Not Found", f"no resource at {self.path}")
        owner, run_id = self._owner(), match.group(1)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            if cancel:
                return 200, dict(owner_view(cancel_run(conn, owner_id=owner, run_id=run_id))), {}
            state = run_status(conn, run_id, owner_id=owner)
        if state is None:
            raise RunNotFound()
        headers = {} if state.terminal else {"Retry-After": "1"}  # a hint for pollers
        return 200, dict(owner_view(state)), headers

    def _owner(self) -> str:
        owner = self.headers.get("X-Owner")
        if not owner:
            raise Problem(401, "unauthenticated", "Unauthenticated", "send X-Owner (stands in for real auth)")
        return owner

    def _json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise Problem(413, "too-large", "Content Too Large", f"at most {MAX_BODY} bytes")
        try:
            return json.loads(self.rfile.read(length) or b"{}")
        except ValueError as exc:
            raise Problem(400, "invalid-json", "Invalid JSON", str(exc)) from None

    def _answer(self, action: Any) -> None:
        try:
            status, body, headers = action()
            ctype = "application/json"
        except Exception as exc:  # noqa: BLE001 - every error becomes a problem document
            problem = _problem(exc, self.path)
            status, body, headers, ctype = problem.status, problem.body, problem.headers, "application/problem+json"
        data = json.dumps(body, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep stdout for events
        pass


def _problem(exc: Exception, path: str) -> Problem:
    if isinstance(exc, Problem):
        return exc
    if isinstance(exc, AdmissionRefused):
        return Problem(503, "queue-full", "Queue Full", str(exc), instance=path, queue=exc.queue,
                       headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, RequestKeyConflict):
        return Problem(409, "idempotency-key-reused", "Idempotency-Key Reused", str(exc), instance=path,
                       run_id=str(exc.run_id))
    if isinstance(exc, RunNotFound):
        return Problem(404, "run-not-found", "Run Not Found", "no such run for this owner", instance=path)
    if isinstance(exc, InvalidJob):
        return Problem(422, "invalid-request", "Invalid Request", str(exc), instance=path)
    return Problem(500, "internal", "Internal Error", type(exc).__name__, instance=path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--capacity-per-s", type=float, default=2.0, help="jobs/s the worker finishes")
    parser.add_argument("--horizon-s", type=float, default=60.0, help="refuse work beyond this horizon")
    args = parser.parse_args()
    Api.dsn = os.environ["OUTBOX_DSN"]
    Api.admission = AdmissionPolicy(capacity_per_s=args.capacity_per_s, horizon_s=args.horizon_s)
    pool = WorkerPool(WorkerConfig(dsn=Api.dsn, max_concurrency=4, queue_limits={"bulk": 3},
                                   owner_limit=2, lease_s=10), {"count_words": count_words})
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Api)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    pool.start()
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
