"""The relay loop's owner: when to claim, when to wait, when to sleep and when to wake.

Each turn (:meth:`Loop.run_once`) decides whether to claim, runs the pump once (settle,
collect marks, claim and produce) and the replayer once, and keeps the loop's own state:
how long the relay has found nothing, whether it sleeps.  Then :meth:`Loop.wait` waits
for the next thing to do:

* busy (rows in flight, or replays): on delivery reports or the oldest mark, 50 ms at most;
* caught up: the relay claims on its own, paced by the pump (5 to 80 ms apart, more rows
  a claim the longer), and writers pay nothing;
* at the first claim that finds nothing (nothing in flight either) it goes to sleep:
  takes the wake-up lock (writers then NOTIFY, see sql/migrations/0003_notify.sql),
  claims once more (a commit may have raced the lock) and waits on LISTEN; asleep it
  claims when woken by a notification (at once: a notification drops the pump's pace,
  never its back-off, and is kept until a claim runs) or when the poll interval is up,
  about one claim per poll interval; without a LISTEN connection (one being re-opened on
  a thread of its own, relay/reopening.py) it cannot sleep, and claims at the poll
  interval until the connection is ready; a claim that finds rows wakes it, and ``on_wake``
  hears what made it claim (``notify``, or ``poll``: rows no notification announced).
  So a row waits at most about 80 ms for its claim at any rate, and a few milliseconds
  when rows come further apart than that (README, "How soon a row leaves");
* never past the pump's own back-off (``claim_not_before``: publish failures, stalled
  partitions) nor past the caller's next due time (lease heartbeat, backlog gauges).

The composition root (relay/app.py) supervises: signals, probes, the database going away
and coming back, leases and backlog when due.  It never reads or writes the pump's
claim state; the loop does, on the loop's thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from relay.model import BatchResult, Lease

#: The shortest wait of an awake relay for its next claim.
BUSY_POLL_BASE_S = 0.005
#: The longest a busy loop waits on delivery reports, marks or replays before a new turn.
BUSY_WAIT_S = 0.05
#: An awake relay's waits up to this long do not listen for notifications
#: (:meth:`relay.wakeup.Wakeup.pause`): a peer's notice about shards is read within the
#: 0.1 s at which the loop looks for one anyway.
AWAKE_PAUSE_MAX_S = 0.1


class LoopPump(Protocol):
    claim_not_before: float
    backoff_until: float
    rewind_requested: bool

    def run_once(self, *, claim: bool = True) -> BatchResult: ...
    def busy(self) -> bool: ...
    def idle(self) -> bool: ...
    def wait(self, timeout_s: float) -> None: ...
    def expect_new_rows(self) -> None: ...
    def request_rewind(self) -> None: ...


class LoopWakeup(Protocol):
    sleeping: bool
    peer_sleeps: bool

    def set_sleeping(self, sleeping: bool) -> bool: ...
    def wait(self, timeout_s: float) -> bool: ...
    def pause(self, timeout_s: float) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class Listens(Protocol):
    """A wake-up that says when its last refused lock found no LISTEN connection to sleep
    on (relay.wakeup.Wakeup: one re-opened on a thread of its own)."""

    not_listening: bool


class _AlwaysListens:
    """Any other wake-up's stand-in: a refused lock is never for want of a connection."""

    not_listening = False


def listens(wakeup: object) -> Listens:
    """``wakeup``, when it says whether it has a LISTEN connection; else a stand-in."""
    return wakeup if isinstance(wakeup, Listens) else _AlwaysListens()


class LoopReplayer(Protocol):
    def run_once(self, leases: Sequence[Lease]) -> Any: ...
    def busy(self) -> bool: ...
    def wait(self, timeout_s: float) -> None: ...


class LoopLeases(Protocol):
    def usable(self, now: float) -> list[Lease]: ...


class Loop:
    """Wake, sleep and claim decisions for one replica.  Driven by the loop's thread."""

    def __init__(self, *, pump: LoopPump, wakeup: LoopWakeup, leases: LoopLeases,
                 poll_interval_s: float, replayer: LoopReplayer | None = None,
                 on_wake: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pump = pump
        self.wakeup = wakeup
        self._listens = listens(wakeup)
        self.leases = leases
        self.replayer = replayer
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.empty_claims = 0  # claims in a row that found nothing, while nothing is in flight
        self.next_poll = 0.0  # asleep: when the next claim is due without a notification
        self.woken = False  # asleep: a notification came; claim on the next turn
        self.claim_woken = False  # asleep: the last claim was the notification's (else the poll's)
        self.on_wake = on_wake
        self.last = BatchResult()  # what the last turn did

    @property
    def sleeping(self) -> bool:
        return self.wakeup.sleeping

    def run_once(self, now: float) -> BatchResult:
        """One turn: claim when due, settle, mark, replay.  Never blocks for long."""
        # Asleep, the relay claims only when woken or when the poll interval is up, not
        # at every heartbeat: about one claim per poll interval when idle.
        sleeping = self.wakeup.sleeping
        claim = not sleeping or self.woken or now >= self.next_poll
        if claim and sleeping and now >= self.next_poll:
            self.next_poll = now + self.poll_interval_s
        result = self.pump.run_once(claim=claim)
        if claim and sleeping and result.claims:
            # A notification is spent only by a claim: one that came while the pump could
            # not claim (a paced claim's wait, a back-off) is claimed once it can, not at
            # the next poll.
            self.claim_woken, self.woken = self.woken, False
        if self.replayer is not None:
            self.replayer.run_once(self.leases.usable(now))
        self.last = result
        return result

    def wait(self, now: float, *, wake_by: float) -> None:
        """After the turn that started at ``now``: wake up if it found rows, else wait for
        the next thing to do, until ``wake_by`` at the latest."""
        if self.last.claimed:
            self.empty_claims = 0
            if self.wakeup.sleeping:
                if self.on_wake is not None:
                    self.on_wake("notify" if self.claim_woken else "poll")
                self.wakeup.set_sleeping(False)
        elif self.last.claims and not self.pump.busy():
            self.empty_claims += 1  # a claim ran and found nothing (not a paced turn)
        if self.last.claimed == 0 or self.pump.claim_not_before > now:
            # Nothing found, or the next claim is paced: a turn right away would claim
            # nothing.  (A full batch is followed by the next claim at once.)
            self._idle_wait(now, wake_by)
        if not self.wakeup.sleeping:
            self.next_poll = 0.0

    def database_lost(self) -> None:
        """The database went away: the next claim starts from "nothing seen", and the
        wake-up lock went with its connection."""
        self.pump.request_rewind()
        self.wakeup.close()

    @staticmethod
    def _until(now: float, latest: float, not_before: float) -> float:
        """When an idle wait ends: at ``latest`` (the poll, the caller's due time), or at
        ``not_before`` when that is still ahead and sooner."""
        return min(latest, not_before) if not_before > now else latest

    def _idle_wait(self, now: float, wake_by: float) -> None:
        pump = self.pump
        next_poll = self.next_poll if self.wakeup.sleeping else now + self.poll_interval_s
        if self.wakeup.sleeping and not self.woken and not pump.busy():
            # Asleep, a turn claims at the poll or once a notification came, and one ends the
            # wait by itself: the pace the poll's claim set (the next claim not before ~80 ms)
            # is no reason to wake, and doing so ran a turn that did nothing each poll
            # interval, half of an idle relay's wake-ups.  The poll itself waits for the pace
            # (or a back-off) when that ends later, rather than find it not due and skip.
            until = min(max(next_poll, pump.claim_not_before), wake_by)
        else:
            until = self._until(now, min(next_poll, wake_by), pump.claim_not_before)
        timeout = max(0.0, until - self.clock())
        if self.replayer is not None and self.replayer.busy() and not pump.busy():
            self.replayer.wait(min(timeout, BUSY_WAIT_S))
            return
        if pump.busy():
            pump.wait(min(timeout, BUSY_WAIT_S))
            if pump.busy() or (self.replayer is not None and self.replayer.busy()):
                return
            # Everything settled before the next claim is due: wait for that here rather
            # than in one more turn of the loop that would do nothing.
            timeout = max(0.0, until - self.clock())
            if timeout <= 0:
                return
        if pump.rewind_requested and pump.idle():
            return
        if not self.wakeup.sleeping:
            if not self.empty_claims:
                # The last claim found rows: wait for the paced claim (waking before it is
                # due runs no claim), never past the caller's due time or the poll interval.
                due_in = max(0.0, pump.claim_not_before - self.clock())
                cap = max(0.0, min(next_poll, wake_by) - self.clock())
                timeout = min(cap, max(BUSY_POLL_BASE_S, due_in))
                if timeout <= AWAKE_PAUSE_MAX_S:
                    # Awake: no writer notifies this relay, so nothing on the LISTEN
                    # socket could end this wait early (a paced claim's, each ~12 ms).
                    self.wakeup.pause(timeout)
                    return
            elif self.wakeup.set_sleeping(True):  # a claim found nothing: sleep
                pump.expect_new_rows()  # one more claim: a commit may have raced the lock
                return
            elif self.wakeup.peer_sleeps or self._listens.not_listening:
                # A peer sleeps, and writers notify every listener, this one too: wait for
                # a notification or the poll, not for the pace (that was a claim and a
                # lock attempt every 80 ms for nothing, 26 statements a second while idle).
                # Or the LISTEN connection is being re-opened (relay/reopening.py): no
                # notification can come, the poll finds the rows; the wait ends early once
                # the connection is ready, and the next turn sleeps on it.
                timeout = max(0.0, self._until(now, min(next_poll, wake_by), pump.backoff_until)
                              - self.clock())
            # else: writers are mid-transaction: their rows come soon, at the paced claim
        if self.wakeup.wait(timeout):
            pump.expect_new_rows()
            self.woken = True
