"""The relay's answers to ``/healthz`` (liveness) and how long it has been held up.

Liveness exists for a wedged relay, which a restart fixes: its loop stopped ticking, or
rows are pending and nothing was published for ``--stuck-after-s`` while the database and
the broker are up.  It does not fail for what a restart cannot fix: an outage of a
dependency (readiness's business), or statements the server says are running or waiting
there (relay/waits.py: a DBA's lock on the outbox, a slow database), or marks the server
cancels, marked again after a back-off (relay/mark_cancels.py: between two tries no
statement of the relay's is on the server, and a restart would publish again every row in
flight).  A wedged loop, with no statement of its own on the server, still fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.app import Relay

#: The loop not ticking for this long (or ten poll intervals, if longer) is a wedged relay.
LOOP_DEAD_AFTER_S = 30.0


def health(relay: Relay, *, loop_connection: str) -> tuple[bool, dict[str, Any]]:
    """``/healthz``: (ok, body).  ``loop_connection``: the application_name of the loop's
    own connection (a wait there explains a loop that does not tick)."""
    now = relay.clock()
    loop_age = now - relay.last_tick
    since_publish = now - (relay.pump.last_marked_at if relay.pump else relay.last_tick)
    # The clock restarts when both dependencies are back, so the first batch after a long
    # outage (acknowledged, its mark on the way) is not taken for a stuck loop.
    since_progress = min(since_publish, now - relay.deps_up_at)
    waits = relay.waits.current()
    loop_waits = any(wait.connection == loop_connection for wait in waits)
    cancelled = relay.pump is not None and relay.pump.marks_cancelled()
    stuck = (relay.pending > 0 and since_progress > relay.settings.stuck_after_s
             and relay.db_up and relay.broker_up and not waits and not cancelled)
    loop_dead = (loop_age > max(LOOP_DEAD_AFTER_S, relay.settings.poll_interval_s * 10)
                 and not relay.stopping and not loop_waits)
    ok = not stuck and not loop_dead
    return ok, {"pending": relay.pending, "seconds_since_publish": round(since_publish, 1),
                "loop_age_s": round(loop_age, 1), "database_waits": [w.describe() for w in waits],
                "marks_cancelled": cancelled}


def held_up_s(relay: Relay) -> float:
    """How long the loop has not ticked, or rows in flight were not marked: when the wait
    watch looks (0 while the database or the broker is known to be away: that is said and
    waited out already)."""
    if not relay.db_up or not relay.broker_up or relay.stopping:
        return 0.0
    now = relay.clock()
    marks = now - relay.pump.last_marked_at if relay.pump is not None and relay.pump.busy() else 0.0
    return max(now - relay.last_tick, marks)
