"""The LISTEN connection re-opened at run time (relay/reopening.py, CheckedWakeup) on a real
PostgreSQL, its re-opens failing: a role refused connections (its backend terminated,
``CONNECTION LIMIT 0``), then every connection reset by the test's TCP proxy.  The loop
never waits for the re-open and polls meanwhile; each streak of failed re-opens is said once
(``listen_reopen_failed``, the error's words with no password) and, as the replays' are
(tests/integration/test_replay_reopen.py), its end too (``listen_reopened``): before, an SRE
alerted by the failure never saw LISTEN come back."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from relay.connections import LISTEN, Checks, Needed
from relay.reopening import CheckedWakeup
from tests.fixtures.procs import wait_until
from tests.fixtures.proxy import TcpProxy
from tests.integration.test_least_privilege import RelayLogin, relay_login  # noqa: F401 - the fixture
from tests.integration.test_replay_reopen import _admin, proxied  # noqa: F401 - the fixture
from tests.unit.test_connections import Log

#: Far more than any back-off (relay/wakeup.py REOPEN_BACKOFF_MAX_S): each turn may re-open.
TURN_S = 60.0


class Turns:
    """The loop's turns of the LISTEN connection (each tries to go to sleep on it), each a
    minute later on its clock."""

    def __init__(self, dsn: str) -> None:
        self.now = [1000.0]
        self.log = Log()
        self.stopping = threading.Event()
        self.wakeup = CheckedWakeup(dsn, owner="listen-reopen", clock=lambda: self.now[0])
        self.wakeup.ping()  # the start's open
        Checks([Needed(*LISTEN, self.wakeup.ping)], log=self.log,
               stopping=self.stopping.is_set).check_reopens(self.wakeup)

    def turn(self) -> bool:
        """Whether the relay could go to sleep (the wake-up lock taken on LISTEN), then awake again."""
        self.now[0] += TURN_S
        slept = self.wakeup.set_sleeping(True)
        if slept:
            self.wakeup.set_sleeping(False)
        return slept

    def events(self, name: str) -> list[dict[str, object]]:
        return [fields for event, fields in self.log.events if event == name]

    def fail_until(self, failures: int) -> None:
        """Turn until ``failures`` re-opens in a row have failed and been read."""
        wait_until(lambda: not self.turn() and self.wakeup._reopen.failures >= failures,
                   timeout_s=30, message=lambda: f"the re-opens did not fail: {self.log.events}")

    def recover(self) -> None:
        wait_until(self.turn, timeout_s=30, message=lambda: f"LISTEN did not come back: {self.log.events}")


@pytest.fixture
def turns(proxied: tuple[str, TcpProxy]) -> Iterator[Turns]:  # noqa: F811
    made = Turns(proxied[0])
    try:
        yield made
    finally:
        made.stopping.set()
        made.wakeup.close()


def test_listen_reopens_that_keep_failing_are_said_once_a_streak_and_their_end_too(
        relay_login: RelayLogin, proxied: tuple[str, TcpProxy], turns: Turns) -> None:  # noqa: F811
    _dsn, proxy = proxied
    password = str(conninfo_to_dict(relay_login.dsn)["password"])
    assert turns.turn()  # listening: the relay can sleep on it
    # A streak: the role refused connections, its LISTEN session ended.
    role = sql.Identifier(relay_login.name)
    _admin(relay_login, sql.SQL("ALTER ROLE {} CONNECTION LIMIT 0").format(role))
    _admin(relay_login, sql.SQL("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name = %s AND usename = %s"), LISTEN[0], relay_login.name)
    turns.fail_until(3)
    assert turns.wakeup.not_listening
    (failed,) = turns.events("listen_reopen_failed")
    assert "too many connections for role" in str(failed["error"]), failed
    assert password not in str(failed), failed
    assert not turns.events("listen_reopened")
    _admin(relay_login, sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(role))
    turns.recover()
    (reopened,) = turns.events("listen_reopened")
    assert reopened["failures"] == 3 and reopened["connection"] == LISTEN[0], reopened
    assert failed["connection"] == LISTEN[0], failed
    # Another streak: every connection through the proxy reset, new ones too.
    proxy.cut()
    turns.fail_until(2)
    assert len(turns.events("listen_reopen_failed")) == 2, turns.log.events
    assert len(turns.events("listen_reopened")) == 1
    proxy.restore()
    turns.recover()
    _first, second = turns.events("listen_reopened")
    assert second["failures"] == 2, second
    (_, cut) = turns.events("listen_reopen_failed")
    assert password not in str(cut), cut
