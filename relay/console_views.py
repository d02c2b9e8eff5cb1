"""HTML of the console: server-rendered, every value escaped, no script.

Payloads, headers and raw error texts are not shown unless asked for on one row
(``?reveal=1``).  Each view returns a ``str`` body; :mod:`relay.console` serves it.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from outbox_core.text import visible

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}
header a{color:#cfd8dc;text-decoration:none}header a.on{color:#fff;font-weight:600}
header .mode{margin-left:auto;font-size:12px;background:#455a64;padding:2px 8px;border-radius:8px}
main{padding:16px}table{border-collapse:collapse;margin:8px 0 16px;background:#fff}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eceff1}td.num{text-align:right}.bad{color:#b71c1c}.ok{color:#1b5e20}
form.inline{display:inline}button{font-size:12px}pre{background:#fff;border:1px solid #ddd;padding:8px;
white-space:pre-wrap;max-width:960px}.flash{background:#fff8e1;border:1px solid #ffe082;padding:6px 10px}
.cards{display:flex;gap:12px}.card{background:#fff;border:1px solid #ddd;padding:8px 14px}
.card b{display:block;font-size:20px}
"""

NAV = (("/", "Status"), ("/dead-letters", "Dead letters"), ("/replays", "Replays"), ("/jobs", "Jobs"))


def e(value: Any) -> str:
    """Escaped text of any value (None shows as a dash).  Control and invisible characters
    show as ``\\u202e``: a key or an error holding a right-to-left override was shown
    reordered (an id read backwards), and a zero-width space made two keys look alike."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return escape(value.isoformat(timespec="seconds"))
    return escape(visible(str(value)), quote=True)


def page(title: str, body: str, *, path: str, who: str | None, actions: bool, flash: str | None) -> str:
    links = "".join(f'<a href="{href}"{" class=on" if path == href else ""}>{e(text)}</a>'
                    for href, text in NAV)
    mode = "actions enabled" if actions else "read-only"
    if actions:
        account = (f'signed in as {e(who)} <a href="/logout">sign out</a>' if who
                   else '<a href="/login">sign in</a>')
    else:
        account = ""
    note = f'<p class="flash" role="status">{e(flash)}</p>' if flash else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{e(title)} - outbox-relay'
            f'</title><link rel="stylesheet" href="/console.css"></head><body><header>'
            f'<strong>outbox-relay</strong>{links}<span class="mode">{mode}</span>{account}</header>'
            f'<main><h1>{e(title)}</h1>{note}{body}</main></body></html>')


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, empty: str = "none") -> str:
    """``rows`` hold HTML already escaped (cells built with :func:`e`)."""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    if not body:
        return f"<p>{e(empty)}</p>"
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def button(action: str, label: str, fields: dict[str, str], csrf: str | None) -> str:
    """A POST form to ``action`` with the session's CSRF token; nothing without a session."""
    if csrf is None:
        return ""
    hidden = "".join(f'<input type="hidden" name="{e(k)}" value="{e(v)}">' for k, v in fields.items())
    return (f'<form class="inline" method="post" action="{e(action)}">{hidden}'
            f'<input type="hidden" name="csrf" value="{e(csrf)}"><button type="submit">{e(label)}</button></form>')


def link(path: str, text: Any, **query: Any) -> str:
    q = urlencode({k: v for k, v in query.items() if v is not None})
    return f'<a href="{e(path + ("?" + q if q else ""))}">{e(text)}</a>'


def status(data: dict[str, Any], replays: list[dict[str, Any]]) -> str:
    b = data["backlog"]
    cards = "".join(f'<div class="card">{e(label)}<b>{value}</b></div>' for label, value in (
        ("pending rows", e(b["pending"])), ("oldest pending age", f'{float(b["oldest_pending_age_s"]):.1f} s'),
        ("retrying rows", e(b["retrying"])), ("dead letters", e(data["dead_letters"])),
        ("active replays", e(sum(1 for r in replays if r["state"] == "active")))))
    shards = table(("shard", "owner", "lease until", "token", "state"), (
        (e(s["shard"]), e(s["owner"]), e(s["lease_until"]), e(s["token"]),
         '<span class="ok">live</span>' if s["live"] else ('<span class="bad">expired</span>'
                                                           if s["owner"] else "free"))
        for s in data["shards"]))
    waiting = table(("reason", "rows", "next retry at", "max attempts"), (
        (e(w["reason"]), e(w["rows"]), e(w["next_retry_at"]), e(w["max_attempts"])) for w in data["waiting"]),
        empty="nothing waits: no row is in back-off")
    stalled = table(("topic", "partition", "rows waiting", "replica"), (
        (e(r["topic"]), e(r["partition"]), e(r["rows_waiting"]), e(r["owner"]))
        for r in data.get("stalled", ())),
        empty="no partition is stalled: every partition acknowledges")
    return (f'<div class="cards">{cards}</div><h2>What waits and why</h2>{waiting}'
            f'<h3>Partitions that acknowledge nothing (no leader?): their keys wait</h3>{stalled}'
            f'<h2>Shards and leases</h2>{shards}')


def dead_letters(rows: list[dict[str, Any]], csrf: str | None) -> str:
    return table(("event_id", "topic", "reason", "attempts", "dead at", ""), (
        (link(f"/dead-letters/{quote(r['event_id'])}", r["event_id"]), e(r["topic"]), e(r["reason"]),
         e(r["attempts"]), e(r["dead_at"]),
         button("/actions/dead-letters/requeue", "requeue", {"event_id": r["event_id"]}, csrf)
         + button("/actions/dead-letters/purge", "purge", {"event_id": r["event_id"]}, csrf))
        for r in rows), empty="no dead letters")


def dead_letter(r: dict[str, Any], *, reveal: bool, csrf: str | None) -> str:
    """One dead letter, its key, payload and headers as the store cut them (each says so,
    with its size, when it was cut)."""
    def clipped(shown: str | None, size: int | None, *, b64: bool = False) -> str:
        if shown is None or size is None:
            return e(shown)
        length = len(base64.b64decode(shown)) if b64 else len(shown.encode())
        if length >= size:
            return e(shown)
        return (f"{e(shown)}… <em>(the first {length:,} of {size:,} bytes: "
                f"<code>outbox-relay dead-letters show {e(r['event_id'])}</code> prints the whole row)</em>")

    fields = table(("field", "value"), (
        (e(k), clipped(r["key"], r["key_bytes"]) if k == "key" else e(r[k])) for k in (
            "event_id", "topic", "key", "reason", "attempts", "created_at", "dead_at", "owner")))
    if reveal:
        payload = (clipped(r["payload"], r["payload_size"]) if r["payload"] is not None
                   else clipped(r["payload_bytes_base64"], r["payload_size"], b64=True))
        content = (f"<h2>Error</h2><pre>{e(r['error'])}</pre>"
                   f"<h2>Headers</h2><pre>{clipped(r['headers'], r['header_bytes'])}</pre>"
                   f"<h2>Payload</h2><pre>{payload}</pre>")
    else:
        content = ("<p>Payload, headers and error text are hidden. "
                   + link(f"/dead-letters/{quote(r['event_id'])}", "show them for this row", reveal=1) + "</p>")
    actions = (button("/actions/dead-letters/requeue", "requeue", {"event_id": r["event_id"]}, csrf)
               + button("/actions/dead-letters/purge", "purge", {"event_id": r["event_id"]}, csrf))
    return f"{fields}{content}<p>{actions}</p>"


def replays(rows: list[dict[str, Any]], csrf: str | None) -> str:
    return table(("id", "state", "range (created_at)", "topics", "keys", "rate/s", "selected", "sent", "left",
                  "shards done", "requested", ""), (
        (e(r["id"]), e(r["state"]), f'{e(r["since"])} .. {e(r["until"])}', e(", ".join(r["topics"]) or "all"),
         e(f'{len(r["keys"])} key(s)' if r["keys"] else "all"), e(f'{float(r["rate_per_s"]):g}'),
         e(r["selected_rows"]), e(r["sent"]), e(r["rows_left"]), e(r["shards_done"]),
         f'{e(r["requested_at"])} by {e(r["requested_by"])}',
         button("/actions/replays/cancel", "cancel", {"replay_id": str(r["id"])}, csrf)
         if r["state"] == "active" else "")
        for r in rows), empty="no replays (outbox-relay replay --since TIME)")


def jobs(by_state: list[dict[str, Any]], runs: list[dict[str, Any]], dead: list[Any],
         filters: dict[str, str | None], csrf: str | None) -> str:
    counts = table(("queue", "state", "jobs"), (
        (link("/jobs", j["queue"], queue=j["queue"]), link("/jobs", j["status"], status=j["status"],
                                                           queue=j["queue"]), e(j["jobs"]))
        for j in by_state), empty="no jobs")
    inputs = "".join(f'<label>{e(k)} <input name="{e(k)}" value="{e(v or "")}" size="12"></label> '
                     for k, v in filters.items())
    form = f'<form method="get" action="/jobs">{inputs}<button type="submit">filter</button></form>'
    run_rows = table(("run", "owner", "kind", "queue", "state", "attempts", "lease owner", "created", "finished"), (
        (link(f"/runs/{r['run_id']}", r["run_id"]), e(r["owner_id"]), e(r["kind"]), e(r["queue"]),
         e(r["status"]), f'{e(r["attempts"])}/{e(r["max_attempts"])}', e(r["lease_owner"]), e(r["created_at"]),
         e(r["finished_at"]))
        for r in runs), empty="no runs match")
    dead_rows = table(("job", "run", "queue", "kind", "reason", "attempts", "dead at", ""), (
        (e(d.job_id), link(f"/runs/{d.run_id}", d.run_id) if d.run_id else "-", e(d.queue), e(d.kind),
         e(d.reason), e(d.attempts), e(d.dead_at),
         button("/actions/jobs/retry", "retry", {"job_id": str(d.job_id)}, csrf))
        for d in dead), empty="no dead jobs")
    return (f"<h2>Jobs by queue and state</h2>{counts}<h2>Runs</h2>{form}{run_rows}"
            f"<h2>Dead letters of the jobs</h2>{dead_rows}")


def run(state: Any, job: dict[str, Any] | None, steps: list[dict[str, Any]], *, reveal: bool,
        csrf: str | None) -> str:
    fields = table(("field", "value"), ((e(k), e(getattr(state, k))) for k in (
        "run_id", "owner_id", "request_key", "kind", "queue", "status", "attempts", "max_attempts",
        "wait_cause", "dead_reason", "created_at", "finished_at", "last_error_type")))
    lease = "" if job is None else table(("lease owner", "token", "lease until", "heartbeat", "available at",
                                          "started", "finished"), [
        (e(job["lease_owner"]), e(job["lease_token"]), e(job["lease_until"]), e(job["heartbeat_at"]),
         e(job["available_at"]), e(job["started_at"]), e(job["finished_at"]))])
    history = table(("step result", "written by token", "at"), (
        (e(s["key"]), e(s["lease_token"]), e(s["written_at"])) for s in steps), empty="no step results yet")
    if state.last_error is None:
        error = ""
    elif reveal:
        error = f"<h2>Last error</h2><pre>{e(state.last_error)}</pre>"
    else:
        error = ("<p>The last error's text is hidden. "
                 + link(f"/runs/{state.run_id}", "show it for this run", reveal=1) + "</p>")
    actions = "" if state.terminal else button("/actions/runs/cancel", "cancel run",
                                               {"run_id": str(state.run_id)}, csrf)
    return (f"{fields}<h2>Lease and attempts</h2>{lease}<h2>History</h2>{history}{error}<p>{actions}</p>")


def login(csrf: str, error: str | None) -> str:
    problem = f'<p class="flash">{e(error)}</p>' if error else ""
    return (f'{problem}<form method="post" action="/login"><input type="hidden" name="csrf" value="{e(csrf)}">'
            '<p><label>Your name (for the action log) <input name="who" required maxlength="64"></label></p>'
            '<p><label>Console token <input name="token" type="password" required></label></p>'
            '<p><button type="submit">sign in</button></p></form>')
