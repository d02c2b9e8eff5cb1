"""Long work over HTTP on asyncio: accept once (202 + the run's URL), poll its status, a worker in-process.

    OUTBOX_DSN=postgresql://... python examples/jobs_http.py --port 8080   # after `outbox-relay migrate`
    curl -i -X POST localhost:8080/runs -H 'X-Owner: alice' -H 'Idempotency-Key: r1' -d '{"words": 3}'
    curl -i localhost:8080/runs/<run_id> -H 'X-Owner: alice'          # poll until "succeeded"
    curl -i -X DELETE localhost:8080/runs/<run_id> -H 'X-Owner: alice'  # cancel

Errors are RFC 9457 problem details; a full queue answers 503 with Retry-After.  X-Owner
stands in for real authentication.  The browser tab owns nothing: the database does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
from dataclasses import dataclass
from http import HTTPStatus
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
    cancel_run,
    owner_view,
)
from consumer_sdk.jobs import aio as jobs

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


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Api:
    """The three routes on asyncio: accept, status and cancel never block the event loop."""

    def __init__(self, dsn: str, admission: AdmissionPolicy | None) -> None:
        self.dsn = dsn
        self.admission = admission

    async def handle(self, req: Request) -> tuple[int, dict[str, Any], dict[str, str]]:
        if req.method == "POST":
            return await self._create(req)
        if req.method in ("GET", "DELETE"):
            return await self._read(req, cancel=req.method == "DELETE")
        raise Problem(405, "method-not-allowed", "Method Not Allowed", f"{req.method} is not supported")

    async def _create(self, req: Request) -> tuple[int, dict[str, Any], dict[str, str]]:
        if req.path != "/runs":
            raise Problem(404, "not-found", "Not Found", f"no resource at {req.path}")
        key = req.headers.get("idempotency-key")
        if not key:
            raise Problem(400, "idempotency-key-required", "Idempotency-Key required",
                          "POST /runs needs an Idempotency-Key header so a retried request is not run twice")
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            run = await jobs.accept(conn, owner_id=_owner(req), request_key=key, kind="count_words",
                                    body=_json(req), traceparent=req.headers.get("traceparent"),
                                    admission=self.admission)
            state = await jobs.run_status(conn, run.run_id)
        assert state is not None
        location = f"/runs/{run.run_id}"
        return 202, {**owner_view(state), "status_url": location}, {"Location": location}

    async def _read(self, req: Request, *, cancel: bool) -> tuple[int, dict[str, Any], dict[str, str]]:
        match = RUN_PATH.match(req.path)
        if match is None:
            raise Problem(404, "not-found", "Not Found", f"no resource at {req.path}")
        owner, run_id = _owner(req), match.group(1)
        if cancel:  # rare: the sync API on a thread
            state = await asyncio.to_thread(self._cancel, owner, run_id)
            return 200, dict(owner_view(state)), {}
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            found = await jobs.run_status(conn, run_id, owner_id=owner)
        if found is None:
            raise RunNotFound()
        headers = {} if found.terminal else {"Retry-After": "1"}  # a hint for pollers
        return 200, dict(owner_view(found)), headers

    def _cancel(self, owner: str, run_id: str) -> Any:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return cancel_run(conn, owner_id=owner, run_id=run_id)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One HTTP/1.1 exchange per connection (Connection: close); enough for the example."""
        path = "?"
        try:
            req = await _read_request(reader)
            path = req.path
            status, body, headers = await self.handle(req)
            ctype = "application/json"
        except Exception as exc:  # noqa: BLE001 - every error becomes a problem document
            problem = _problem(exc, path)
            status, body, headers, ctype = problem.status, problem.body, problem.headers, "application/problem+json"
        data = json.dumps(body, default=str).encode()
        head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Content-Type: {ctype}",
                f"Content-Length: {len(data)}", "Connection: close",
                *(f"{name}: {value}" for name, value in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        try:
            await writer.drain()
        finally:
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> Request:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    method, target, _version = head[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    length = int(headers.get("content-length") or 0)
    if length > MAX_BODY:
        raise Problem(413, "too-large", "Content Too Large", f"at most {MAX_BODY} bytes")
    return Request(method, target, headers, await reader.readexactly(length) if length else b"")


def _owner(req: Request) -> str:
    owner = req.headers.get("x-owner")
    if not owner:
        raise Problem(401, "unauthenticated", "Unauthenticated", "send X-Owner (stands in for real auth)")
    return owner


def _json(req: Request) -> Any:
    try:
        return json.loads(req.body or b"{}")
    except ValueError as exc:
        raise Problem(400, "invalid-json", "Invalid JSON", str(exc)) from None


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


async def serve(args: argparse.Namespace, dsn: str) -> None:
    api = Api(dsn, AdmissionPolicy(capacity_per_s=args.capacity_per_s, horizon_s=args.horizon_s))
    pool = WorkerPool(WorkerConfig(dsn=dsn, max_concurrency=4, queue_limits={"bulk": 3},
                                   owner_limit=2, lease_duration_s=10), {"count_words": count_words})
    server = await asyncio.start_server(api.serve, "127.0.0.1", args.port)
    stopped = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
    pool.start()
    print(f"listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    try:
        async with server:
            await stopped.wait()
    finally:
        await asyncio.to_thread(pool.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--capacity-per-s", type=float, default=2.0, help="jobs/s the worker finishes")
    parser.add_argument("--horizon-s", type=float, default=60.0, help="refuse work beyond this horizon")
    asyncio.run(serve(parser.parse_args(), os.environ["OUTBOX_DSN"]))


if __name__ == "__main__":
    main()
