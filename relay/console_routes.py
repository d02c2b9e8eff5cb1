"""The console's pages and actions (see :mod:`relay.console` for its security)."""

from __future__ import annotations

import hmac
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import psycopg

from consumer_sdk.errors import OutboxSdkError
from outbox_core.text import uuid_from_text
from relay import console_views as views
from relay.errors import RelayError

if TYPE_CHECKING:
    from relay.console import Console, Session

_ACTIONS = {
    "/actions/dead-letters/requeue": ("event_id", "/dead-letters"),
    "/actions/dead-letters/purge": ("event_id", "/dead-letters"),
    "/actions/replays/cancel": ("replay_id", "/replays"),
    "/actions/jobs/retry": ("job_id", "/jobs"),
    "/actions/runs/cancel": ("run_id", "/jobs"),
}


def _uuid(text: str) -> str | None:
    """A UUID's text in canonical form, or None: an address or a form's id that is not one
    is refused here (404, "not an event_id"), before PostgreSQL's uuid input or the jobs
    API refuse it with an error the handler did not expect (no answer, a traceback)."""
    parsed = uuid_from_text(text)
    return None if parsed is None else str(parsed)


class Routes:
    """One request: ``get(path, query)`` or ``post(path, form)``."""

    def __init__(self, console: Console, handler: Any) -> None:
        self.c = console
        self.h = handler
        found = console.session(handler.headers.get("Cookie"))
        self.sid: str | None = found[0] if found else None
        self.session: Session | None = found[1] if found else None

    @property
    def csrf(self) -> str | None:
        """The form token of an action button: only with actions on and a session."""
        return self.session.csrf if self.c.actions and self.session is not None else None

    def _page(self, title: str, body: str, path: str, query: dict[str, str],
              status: int = HTTPStatus.OK) -> None:
        who = self.session.who if self.session else None
        flash = query.get("done")
        if flash is not None and not hmac.compare_digest(query.get("sig", ""), self.c.flash_sig(flash)):
            flash = None  # not this console's: any text was shown as an action's result
        self.h.send_page(status, views.page(title, body, path=path, who=who, actions=self.c.actions,
                                            flash=flash))

    def get(self, path: str, query: dict[str, str]) -> None:
        try:
            self._get(path, query)
        except (ValueError, psycopg.DataError) as exc:  # a filter with a NUL, a malformed job id
            self.c.store.reset()
            self._page("Bad request", f"<p>{views.e(exc)}</p>", path, {}, HTTPStatus.BAD_REQUEST)
        except (RelayError, OutboxSdkError, psycopg.Error) as exc:  # the jobs' pages raise the SDK's
            self.c.store.reset()
            self.c.log.warning("console_database_error", error=str(exc))
            self._page("Database unavailable", f"<p>{views.e(exc)}</p>", path, {},
                       HTTPStatus.SERVICE_UNAVAILABLE)

    def _get(self, path: str, query: dict[str, str]) -> None:
        store = self.c.store
        if path == "/console.css":
            self.h.send_page(HTTPStatus.OK, views.CSS, content_type="text/css; charset=utf-8")
        elif path == "/":
            self._page("Relay status", views.status(store.status(), store.list_replays(limit=20)), path, query)
        elif path == "/dead-letters":
            self._page("Dead letters", views.dead_letters(store.dead_letters(), self.csrf), path, query)
        elif path.startswith("/dead-letters/") and (event_id := _uuid(path.rsplit("/", 1)[1])):
            row = store.dead_letter_row(event_id)
            if row is None:
                self._page("Not found", "<p>no such dead letter</p>", path, query, HTTPStatus.NOT_FOUND)
                return
            reveal = query.get("reveal") == "1"
            if reveal:
                self._log("reveal_dead_letter", row["event_id"], "shown")
            self._page(f"Dead letter {row['event_id']}", views.dead_letter(row, reveal=reveal, csrf=self.csrf),
                       "/dead-letters", query)
        elif path == "/replays":
            self._page("Replays", views.replays(store.list_replays(limit=100), self.csrf), path, query)
        elif path == "/jobs":
            filters = {k: (query.get(k) or None) for k in ("status", "owner", "queue")}
            runs = store.runs(status=filters["status"], owner=filters["owner"], queue=filters["queue"])
            body = views.jobs(store.jobs_by_state(), runs, store.job_dead_letters(),
                              filters, self.csrf)
            self._page("Jobs", body, path, query)
        elif path.startswith("/runs/") and (run_id := _uuid(path.rsplit("/", 1)[1])):
            state, job, steps = store.run(run_id)
            if state is None:
                self._page("Not found", "<p>no such run</p>", path, query, HTTPStatus.NOT_FOUND)
                return
            reveal = query.get("reveal") == "1"
            if reveal:
                self._log("reveal_run_error", str(state.run_id), "shown")
            self._page(f"Run {state.run_id}", views.run(state, job, steps, reveal=reveal, csrf=self.csrf),
                       "/jobs", query)
        elif path == "/login" and self.c.actions:
            self._page("Sign in", views.login(self.c.new_login_csrf(), None), path, query)
        elif path == "/logout":
            if self.sid is not None:
                self.c.sessions.pop(self.sid, None)
            self.h.redirect("/", cookie=f"{COOKIE_CLEAR}")
        else:
            self._page("Not found", "<p>no such page</p>", path, {}, HTTPStatus.NOT_FOUND)

    # -- POST -----------------------------------------------------------------------------

    def post(self, path: str, form: dict[str, str]) -> None:
        if not self.c.actions:
            self._refuse(path, "read_only", "the console is read-only (start it with --console-actions)")
            return
        if path == "/login":
            self._login(form)
            return
        if self.session is None:
            self._refuse(path, "no_session", "sign in first")
            return
        if not hmac.compare_digest(form.get("csrf", "").encode(), self.session.csrf.encode()):
            self._refuse(path, "csrf", "stale or missing form token: reload the page")
            return
        if path not in _ACTIONS:
            self._refuse(path, "unknown_action", "no such action")
            return
        field, back = _ACTIONS[path]
        target = form.get(field, "")
        try:
            result = self._act(path, target)
        except (RelayError, OutboxSdkError, ValueError, psycopg.Error) as exc:
            self.c.store.reset()  # the jobs' actions raise the SDK's errors: they crashed the request
            result = f"failed: {exc}"
        self._log(path.removeprefix("/actions/"), target, result)
        done = f"{path.removeprefix('/actions/')} {target}: {result}"
        self.h.redirect(back + "?" + urlencode({"done": done, "sig": self.c.flash_sig(done)}))

    def _act(self, path: str, target: str) -> str:
        store = self.c.store
        if path.startswith("/actions/dead-letters/"):
            event_id = _uuid(target)
            if event_id is None:
                raise ValueError("not an event_id")
            moved = store.move_dead_letter(path.rsplit("/", 1)[1], event_id)
            return f"{'requeued' if path.endswith('requeue') else 'purged'} {moved}"
        if path == "/actions/replays/cancel":
            return "cancelled" if store.cancel(int(target)) else "not active"
        if path == "/actions/jobs/retry":
            return "queued again" if store.retry_job(int(target)) else "no dead letter"
        run_id = _uuid(target)
        if run_id is None:
            raise ValueError("not a run id")
        return f"now {store.cancel_run(run_id)}"

    def _login(self, form: dict[str, str]) -> None:
        wait_s = self.c.sign_in_wait_s()
        if wait_s > 0:
            self.c.log.warning("console_refused", client=self.h.client_address[0], path="/login",
                               reason="too_many_refused_sign_ins", retry_in_s=round(wait_s, 1))
            self._page("Sign in", views.login(self.c.new_login_csrf(), "too many refused sign-ins: try again "
                                              f"in {int(wait_s) + 1} s"), "/login", {}, HTTPStatus.TOO_MANY_REQUESTS)
            return
        csrf = form.get("csrf", "")
        fresh = self.c.login_csrf.pop(csrf, None) is not None
        who = " ".join(form.get("who", "").split())[:64]
        sid = self.c.sign_in(who, form.get("token", "")) if fresh and who else None
        if sid is None:
            self.c.sign_in_refused()
            self.c.log.warning("console_sign_in_refused", client=self.h.client_address[0], who=who)
            self._page("Sign in", views.login(self.c.new_login_csrf(), "wrong token, name missing or stale form"),
                       "/login", {}, HTTPStatus.FORBIDDEN)
            return
        self.c.log.info("console_signed_in", who=who, client=self.h.client_address[0])
        self.h.redirect("/", cookie=f"{COOKIE}={sid}; HttpOnly; SameSite=Strict; Path=/")

    def _refuse(self, path: str, reason: str, text: str) -> None:
        self.c.log.warning("console_refused", client=self.h.client_address[0], path=path, reason=reason,
                           who=self.session.who if self.session else None)
        self._page("Refused", f"<p>{views.e(text)}</p>", path, {}, HTTPStatus.FORBIDDEN)

    def _log(self, action: str, target: str, result: str) -> None:
        self.c.log.info("console_action", who=self.session.who if self.session else None,
                        client=self.h.client_address[0], action=action, target=target, result=result)


COOKIE = "outbox_console"
COOKIE_CLEAR = f"{COOKIE}=; Max-Age=0; HttpOnly; SameSite=Strict; Path=/"
__all__ = ["Routes"]
