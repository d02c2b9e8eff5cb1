"""The console's database side: relay status, dead letters, replays and the jobs tables.

A :class:`~relay.store.Store` (one autocommit connection, errors translated at the
seam) with the console's reads; actions reuse :mod:`relay.admin`, the replay store's
statements and :mod:`consumer_sdk.jobs`'s admin functions on the same connection.
"""

from __future__ import annotations

from typing import Any

from consumer_sdk.jobs import admin as jobs_admin
from consumer_sdk.jobs.model import DeadLetterRecord, RunState
from consumer_sdk.jobs.runs import cancel_run, run_status
from relay import admin
from relay.db import translated
from relay.replay_store import ReplayStore

#: A dead letter's page shows its key, payload and headers up to this many characters
#: (``outbox-relay dead-letters show`` prints the whole row): a row dead-lettered for its
#: size can be tens of megabytes.
PAGE_CHARS = 10_000


class ConsoleStore(ReplayStore):
    """Owned by the console's (single) request thread."""

    def status(self) -> dict[str, Any]:
        (backlog,) = self._fetch("admin", "status_backlog", {})
        (dead,) = self._fetch("admin", "status_dead_letters", {})
        return {"backlog": backlog, "dead_letters": int(dead["dead_letters"]),
                "shards": self.shard_table(), "waiting": self._fetch("console", "waiting", {}),
                "stalled": self._fetch("admin", "status_stalled", {})}

    # -- relay dead letters (relay/admin.py) ----------------------------------------------

    def dead_letters(self, *, limit: int = 200) -> list[dict[str, Any]]:
        with translated():
            return admin.list_dead_letters(self.conn, limit=limit)

    def dead_letter_row(self, event_id: str) -> dict[str, Any] | None:
        """The row with its key, payload and headers cut to ``PAGE_CHARS`` characters."""
        with translated():
            return admin.show_dead_letter(self.conn, event_id, max_chars=PAGE_CHARS)

    def move_dead_letter(self, action: str, event_id: str) -> int:
        with translated():
            return len(admin.move_dead_letters(self.conn, action, event_ids=[event_id], every=False,
                                               table=self.table))

    # -- jobs (consumer_sdk.jobs) ---------------------------------------------------------

    def jobs_by_state(self) -> list[dict[str, Any]]:
        return self._fetch("console", "jobs_by_state", {})

    def runs(self, *, status: str | None, owner: str | None, queue: str | None,
             limit: int = 100) -> list[dict[str, Any]]:
        return self._fetch("console", "runs_list", {"status": status, "owner": owner, "queue": queue,
                                                    "limit": limit})

    def run(self, run_id: str) -> tuple[RunState | None, dict[str, Any] | None, list[dict[str, Any]]]:
        with translated():
            state = run_status(self.conn, run_id)
        if state is None:
            return None, None, []
        jobs = self._fetch("console", "run_job", {"run_id": run_id})
        job = jobs[0] if jobs else None
        steps = self._fetch("console", "run_steps", {"job_id": state.job_id})
        return state, job, steps

    def job_dead_letters(self, *, limit: int = 100) -> list[DeadLetterRecord]:
        with translated():
            return jobs_admin.dead_letters(self.conn, limit=limit)

    def retry_job(self, job_id: int) -> bool:
        with translated():
            return jobs_admin.requeue_dead(self.conn, job_id)

    def cancel_run(self, run_id: str) -> str:
        with translated():
            state = run_status(self.conn, run_id)
            if state is None:
                return "no such run"
            return cancel_run(self.conn, owner_id=state.owner_id, run_id=run_id).status
