"""The relay's connections that re-open themselves at run time, each checked as at start
(relay/connections.py: named within ``CONNECTION_WAIT_S`` with the count the relay needs,
then waited for): the LISTEN connection and the replays', on threads of their own that the
loop never waits for (:class:`CheckedWakeup`, :class:`ReopeningReplayer`), and the stores
of the mark, cleanup and exactly-once recovery threads, on the thread that uses them
(:class:`CheckedStore`).  After a database restart or failover behind a session pooler
with no server free, one of them queued in the pooler held the loop, or marking, cleanup
or a shard's recovery, without a word.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from relay.config import mask_text
from relay.connections import LISTEN, Checks, Rechecked
from relay.errors import DatabaseUnavailable, RetriableError
from relay.store import Store
from relay.wakeup import Attempt, NotListening, Opening, ReopenBackOff, Wakeup


class CheckedWakeup(Wakeup, Rechecked):
    """The LISTEN connection (relay/wakeup.py), which re-opens itself when it broke, without
    the loop seeing a database error: once :attr:`checks` is set (after the start's check),
    each re-open is checked as at start, on a thread of its own (``outbox-relay-listen-reopen``),
    and the loop never waits for it.  LISTEN only speeds discovery: behind a session pooler
    with no server free, the re-open waited at its first statement on the loop's thread and
    held the loop there (no claim, no mark, the claims connection working).  Now the loop
    goes on polling (``Wakeup.not_listening``) and adopts the connection, its LISTEN
    statements run, once ready; a failed attempt is tried again after the back-off of
    :data:`relay.wakeup.REOPEN_BACKOFF_S`, a fatal one (rejected credentials) raised on the
    loop's thread.  :meth:`close` (database lost, relay stopping) abandons an attempt.  A
    streak of failed re-opens is said once (``listen_reopen_failed``, the error's words with
    no password) and its end too (``listen_reopened``), as the replays' are."""

    _opening: Opening | None = None  # the re-open under way; the loop's thread's

    def _listening(self) -> Any:
        if self.checks is None or (self._conn is not None and not self._conn.closed):
            return super()._listening()
        opening = self._opening
        if opening is None:
            if not self._reopen.due():
                raise NotListening()  # the back-off after a failed attempt
            self._opening = opening = self._open_in_background(self.checks)
        if not opening.done.is_set():
            raise NotListening(opening.done)
        self._opening = None
        conn = opening.take()
        if conn is not None:
            self._said_reopened(self.checks, self._reopen.passed())
            return self._adopt(conn)
        if opening.error is not None and not isinstance(opening.error, RetriableError):
            raise opening.error
        if self._reopen.failed() and opening.error is not None:  # once a streak: it was silent
            self.checks.log.warning("listen_reopen_failed", connection=LISTEN[0], error=mask_text(str(opening.error)),
                                    detail=f"could not re-open the LISTEN connection ({LISTEN[0]}); the "
                                           "relay claims every --poll-interval-s until it is back, and tries "
                                           "again with back-off")
        raise NotListening()

    @staticmethod
    def _said_reopened(checks: Checks, failures: int) -> None:
        """The end of a streak of failed re-opens said, as the replays' is (``replay_reopened``):
        an SRE alerted by ``listen_reopen_failed`` sees when LISTEN is back.  Not a stop's
        (its attempt gives up, nothing is adopted)."""
        if failures and not checks.stopping():
            checks.log.info("listen_reopened", connection=LISTEN[0], failures=failures,
                            detail=f"the LISTEN connection ({LISTEN[0]}) is back after {failures} failed "
                                   "re-opens; an idle relay sleeps on it again")

    def _open_in_background(self, checks: Checks) -> Opening:
        opening = Opening()

        def reopen() -> None:
            if not checks.reopen(LISTEN[0], lambda: opening.put(self._open_listening(lambda: None)),
                                 abandoned=lambda: opening.abandoned):
                opening.abandon()  # stopped: whatever comes is closed

        return opening.start("outbox-relay-listen-reopen", reopen)

    def close(self) -> None:
        super().close()
        if self._opening is not None:
            self._opening.abandon()
            self._opening = None


class CheckedStore(Store, Rechecked):
    """A store used on a thread of its own (the mark threads', relay/marker.py, the cleanup
    thread's, relay/janitor.py, the exactly-once shard workers', relay/exactly_once.py),
    whose connection re-opens at its next statement after it broke: once :attr:`checks` is
    set, each re-open is checked as at start on the thread that needs it.  Behind a session pooler with no server free, a re-opened mark
    connection waited at its first statement and marking stopped without a word.  The
    check runs only when the connection is re-opened, never per statement; the first open
    of an optional mark connection is its lane's probe's (relay/marker.py), not checked.  A
    stop of the relay ends a wait within half a second, during the drain too: the statement
    raises DatabaseUnavailable (a mark's rows stay pending), the thread goes on to its end."""

    _opened = False  # it had a connection: the next open is a re-open
    #: The connection it had is closed or broke (this store's test before it re-opens): its
    #: next statement re-opens it, and may wait.  A plain attribute, kept as the connection
    #: closes and opens, so that the pump's test before a mark on its own thread costs one
    #: look (relay/pump_settle.py: such a mark goes to the mark thread instead).
    #: Not derivable from the connection: it turns False only once the re-open's check
    #: returned (its first round trip answered), while the store has a connection object as
    #: soon as PgBouncer in session mode accepts the client, before a server is free.  A
    #: property reading the connection let the wait watch look (relay/app.py) and take the
    #: server the re-open waited for: the relay stalled (CI, reverted in 8b16bdb).
    needs_reopen = False

    @property
    def conn(self) -> Any:
        current = self._conn
        if current is not None and not current.closed:
            return current
        if self.checks is None or not self._opened:
            current = super().conn
            self._opened = True
        elif not self.checks.reopen(self._application_name, self._open):
            raise DatabaseUnavailable(f"stopped while waiting for the connection {self._application_name}")
        else:
            current = super().conn
        self.needs_reopen = False
        return current

    def close(self) -> None:
        super().close()
        self.needs_reopen = self._opened

    def _failed(self, exc: Any) -> NoReturn:
        try:
            super()._failed(exc)
        finally:  # one the driver found broken without an error that drops it
            current = self._conn
            self.needs_reopen = self._opened and (current is None or current.closed)

    def _open(self) -> object:
        return super().conn


class ReopeningReplayer(Rechecked):
    """The replayer (relay/replay.py) as the loop runs it: when a statement on its connection
    (``...:replay``) fails, that re-opens on a thread of its own, checked as at start, and
    replays wait meanwhile (after a failed re-open, :data:`relay.wakeup.REOPEN_BACKOFF_S`
    doubling); the loop neither waits for it nor touches the store until it ended.  A streak
    of failed re-opens is said once (``replay_reopen_failed``) and its end too
    (``replay_reopened``): before, replays stopped and nothing said why.  Before,
    that break alone was the database down (database_unavailable, a rewind, LISTEN dropped),
    and behind a session pooler with no server free the re-open (Checks.reopened) held the
    loop: no claim, mark or heartbeat, for replays.  The claims say whether the database is
    down.  Owned by the loop's thread."""

    def __init__(self, replayer: Any, store: Any, *, name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``store``: the replayer's; ``name``: its connection's application_name."""
        self.replayer, self._store, self._name = replayer, store, name
        self._broken = False  # its connection must be re-opened before a replay runs
        self._reopening: Attempt | None = None
        self._reopen = ReopenBackOff(clock)

    def run_once(self, leases: Sequence[Any]) -> Any:
        if not self._usable():
            return None
        try:
            return self.replayer.run_once(leases)
        except DatabaseUnavailable:
            if self.checks is None:
                raise
            self._store.close()  # re-opened by the next turn, on a thread of its own
            self._broken = True
            return None

    def busy(self) -> bool:
        return not self._broken and bool(self.replayer.busy())

    def wait(self, timeout_s: float) -> None:
        self.replayer.wait(timeout_s)

    def _usable(self) -> bool:
        attempt = self._reopening
        if attempt is not None:
            if not attempt.done.is_set():
                return False
            self._reopening = None
            if attempt.error is None:
                self._broken = False
                self._said_reopened(self._reopen.passed())
                return True
            if not isinstance(attempt.error, RetriableError):
                raise attempt.error
            if self._reopen.failed():  # once a streak: it was silent, replays just stopped
                self._said_failed(attempt.error)
        if self._broken and self.checks is not None and self._reopen.due():
            checks = self.checks
            self._reopening = Attempt().start("outbox-relay-replay-reopen",
                                              lambda: checks.reopen(self._name, self._store.ping))
        return not self._broken

    def _said_failed(self, error: BaseException) -> None:
        if self.checks is not None:
            self.checks.log.warning(
                "replay_reopen_failed", connection=self._name, error=mask_text(str(error)),
                detail=f"could not re-open the replays' connection ({self._name}); replays pause "
                       f"until it is back, and it is tried again with back-off")

    def _said_reopened(self, failures: int) -> None:
        """The end of a streak said (not a stop's: its attempt gives up and is not failed)."""
        if failures and self.checks is not None and not self.checks.stopping():
            self.checks.log.info("replay_reopened", connection=self._name, failures=failures,
                                 detail=f"the replays' connection ({self._name}) is back after "
                                        f"{failures} failed re-opens; replays resume")
