"""The replays' connection re-opened at run time (relay/reopening.py, ReopeningReplayer)
on a real PostgreSQL, its re-opens failing: a role refused connections (its backend
terminated, ``CONNECTION LIMIT 0``), then every connection reset by the test's TCP proxy.
The loop never waits for the re-open and replays pause meanwhile; before, a re-open that
kept failing said nothing, and an SRE saw replays not running and no reason.  Now each
streak is said once (``replay_reopen_failed``, the error's words with no password) and its
end too (``replay_reopened``), as the LISTEN connection's are (``listen_reopen_failed``)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.connections import Checks, Needed
from relay.metrics import RelayMetrics
from relay.reopening import ReopeningReplayer
from relay.replay import Replayer, ReplayResult
from relay.replay_store import ReplayStore
from tests.fixtures.procs import wait_until
from tests.fixtures.proxy import TcpProxy
from tests.integration.test_least_privilege import RelayLogin, relay_login  # noqa: F401 - the fixture
from tests.unit.test_connections import Log

#: Far more than any back-off (relay/wakeup.py REOPEN_BACKOFF_MAX_S) and the replays' idle
#: refresh: each turn of the loop may re-open, and each usable turn makes a round trip.
TURN_S = 60.0


class NoBroker:
    """The replays' sink: no replay is requested, so nothing is published (a replay's
    publishing is tests/integration/kafka's); a call would be a defect here."""

    def poll(self, _timeout_s: float) -> int:
        raise AssertionError("no replay is active: nothing to publish")


class Turns:
    """The loop's turns of the replays, each a minute later on the replays' clock."""

    def __init__(self, store: ReplayStore, name: str) -> None:
        self.now = [1000.0]
        self.log = Log()
        self.stopping = threading.Event()
        replayer = Replayer(store, NoBroker(), owner="reopen", nshards=1,  # type: ignore[arg-type]
                            metrics=RelayMetrics(), log=Log(), clock=lambda: self.now[0])
        self.replaying = ReopeningReplayer(replayer, store, name=name, clock=lambda: self.now[0])
        Checks([Needed(name, "replays", store.ping)], log=self.log,
               stopping=self.stopping.is_set).check_reopens(self.replaying)

    def turn(self) -> Any:
        self.now[0] += TURN_S
        return self.replaying.run_once([])

    def events(self, name: str) -> list[dict[str, object]]:
        return [fields for event, fields in self.log.events if event == name]

    def fail_until(self, failures: int) -> None:
        """Turn until ``failures`` re-opens in a row have failed and been read."""
        wait_until(lambda: self.turn() is None and self.replaying._reopen.failures >= failures,
                   timeout_s=30, message=lambda: f"the re-opens did not fail: {self.log.events}")

    def recover(self) -> None:
        wait_until(lambda: isinstance(self.turn(), ReplayResult), timeout_s=30,
                   message=lambda: f"replays did not resume: {self.log.events}")


@pytest.fixture
def proxied(relay_login: RelayLogin, tcp_proxy: Callable[[str, int], TcpProxy]) -> Iterator[tuple[str, TcpProxy]]:  # noqa: F811
    """The login role's DSN (with its password) through a TCP proxy."""
    target = conninfo_to_dict(relay_login.dsn)
    proxy = tcp_proxy(str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432))
    yield make_conninfo(relay_login.dsn, host="127.0.0.1", hostaddr="", port=proxy.port), proxy


def _admin(relay_login: RelayLogin, statement: sql.Composable, *params: object) -> None:  # noqa: F811
    with psycopg.connect(relay_login.admin_dsn, autocommit=True) as conn:
        conn.execute(statement, params or None)


def test_replay_reopens_that_keep_failing_are_said_once_a_streak_and_their_end_too(
        relay_login: RelayLogin, proxied: tuple[str, TcpProxy]) -> None:  # noqa: F811
    dsn, proxy = proxied
    password = str(conninfo_to_dict(relay_login.dsn)["password"])
    name = f"outbox-relay:reopen-{uuid.uuid4().hex[:8]}:replay"
    store = ReplayStore(dsn, application_name=name)
    turns = Turns(store, name)
    try:
        assert isinstance(turns.turn(), ReplayResult)  # its connection is open
        # A streak: the role refused connections, its session ended.
        role = sql.Identifier(relay_login.name)
        _admin(relay_login, sql.SQL("ALTER ROLE {} CONNECTION LIMIT 0").format(role))
        _admin(relay_login, sql.SQL("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                    "WHERE application_name = %s"), name)
        turns.fail_until(3)
        assert not turns.replaying.busy()
        (failed,) = turns.events("replay_reopen_failed")
        assert "too many connections for role" in str(failed["error"]), failed
        assert password not in str(failed), failed
        assert "replays" in str(failed["detail"]) and name in str(failed["detail"]), failed
        assert not turns.events("replay_reopened")
        _admin(relay_login, sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(role))
        turns.recover()
        (reopened,) = turns.events("replay_reopened")
        assert reopened["failures"] == 3 and reopened["connection"] == name, reopened
        # Another streak: every connection through the proxy reset, new ones too.
        proxy.cut()
        turns.fail_until(2)
        assert len(turns.events("replay_reopen_failed")) == 2, turns.log.events
        assert len(turns.events("replay_reopened")) == 1
        proxy.restore()
        turns.recover()
        first, second = turns.events("replay_reopened")
        assert second["failures"] == 2, second
        (_, cut) = turns.events("replay_reopen_failed")
        assert password not in str(cut), cut
    finally:
        turns.stopping.set()
        store.close()
