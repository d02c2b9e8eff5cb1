"""The replays' failed re-opens are said with the error's words, never a DSN's password
(relay/reopening.py ReopeningReplayer; the real database's case is
tests/integration/test_replay_reopen.py)."""

from __future__ import annotations

import threading

import pytest

from relay.connections import Checks, Needed
from relay.errors import DatabaseUnavailable
from relay.reopening import ReopeningReplayer
from tests.fixtures.procs import wait_until
from tests.unit.test_connection_reopen import Replays, ReplayStore
from tests.unit.test_connections import Log


def test_a_failed_replay_reopen_is_said_with_the_dsns_password_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("relay.connections.CONNECTION_WAIT_S", 5.0)
    log, now = Log(), [100.0]
    replays, store = Replays(), ReplayStore()
    replaying = ReopeningReplayer(replays, store, name="relay:replay", clock=lambda: now[0])
    Checks([Needed("relay:replay", "replays", store.ping)], log=log,
           stopping=threading.Event().is_set).check_reopens(replaying)
    replays.broken, store.error = True, DatabaseUnavailable(
        "database unreachable: could not open postgresql://relay:s3cr3t-pw@db.internal:5432/app")
    store.served.set()
    assert replaying.run_once([]) is None  # broke: re-opened on its own thread
    wait_until(lambda: replaying.run_once([]) is None and log.events, timeout_s=10,
               message="the failed re-open was not said")
    ((event, fields),) = log.events
    assert event == "replay_reopen_failed" and fields["connection"] == "relay:replay", fields
    assert "s3cr3t-pw" not in str(fields) and "postgresql://relay:***@db.internal" in str(fields["error"]), fields
