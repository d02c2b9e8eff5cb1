"""The LISTEN connection's failed re-opens are said with the error's words, never a DSN's
password (relay/reopening.py CheckedWakeup), as the replays' are
(tests/unit/test_replay_reopen_log.py); the streak's end is tests/unit/test_connection_reopen.py's."""

from __future__ import annotations

import threading

from relay.connections import LISTEN
from relay.errors import DatabaseUnavailable
from tests.fixtures.procs import wait_until
from tests.unit.test_connection_reopen import Connects, _listening
from tests.unit.test_connection_reopen import connects as connects  # noqa: F401 - the fixture
from tests.unit.test_connections import Log


def test_a_failed_listen_reopen_is_said_with_the_dsns_password_masked(connects: Connects) -> None:  # noqa: F811
    log, now = Log(), [100.0]
    wakeup, _first = _listening(connects, log, threading.Event(), now)
    connects.error = DatabaseUnavailable(
        "database unreachable: could not open postgresql://relay:s3cr3t-pw@db.internal:5432/app")
    wait_until(lambda: wakeup.set_sleeping(True) is False and wakeup._opening is None
               and any(event == "listen_reopen_failed" for event, _ in log.events),
               timeout_s=10, message=lambda: f"the failed re-open was not said: {log.events}")
    (fields,) = [fields for event, fields in log.events if event == "listen_reopen_failed"]
    assert "s3cr3t-pw" not in str(fields) and "postgresql://relay:***@db.internal" in str(fields["error"]), fields
    assert fields["connection"] == LISTEN[0], fields
