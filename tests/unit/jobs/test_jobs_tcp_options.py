"""The TCP settings of a worker pool's connections, from its lease and heartbeat, and the DSN's
own values winning (outbox_core.connect_errors.unset_options, as for connect_timeout).  The
kernel's view of them is tests/integration/jobs/test_jobs_stop_bound.py."""

from __future__ import annotations

import pytest

from consumer_sdk.jobs import WorkerConfig
from consumer_sdk.jobs._conn import tcp_options
from outbox_core.connect_errors import connect_timeout, unset_options


@pytest.mark.parametrize(("lease_s", "heartbeat_s", "expected"), [
    (30.0, None, {"keepalives_idle": 10, "keepalives_interval": 3, "tcp_user_timeout": 30_000}),
    (3.0, 1.0, {"keepalives_idle": 1, "keepalives_interval": 1, "tcp_user_timeout": 3_000}),
    (1.0, None, {"keepalives_idle": 1, "keepalives_interval": 1, "tcp_user_timeout": 1_000}),  # whole seconds
    (600.0, 60.0, {"keepalives_idle": 60, "keepalives_interval": 20, "tcp_user_timeout": 600_000}),
])
def test_the_keepalives_follow_the_heartbeat_and_the_user_timeout_the_lease(
        lease_s: float, heartbeat_s: float | None, expected: dict[str, int]) -> None:
    config = WorkerConfig(dsn="postgresql://h/d", lease_duration_s=lease_s, heartbeat_interval_s=heartbeat_s)
    assert tcp_options(config) == {"keepalives": 1, "keepalives_count": 3, **expected}


def test_what_the_dsn_sets_is_left_to_the_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    ours = {"keepalives": 1, "keepalives_idle": 10, "tcp_user_timeout": 30_000}
    assert unset_options("host=h dbname=d", ours) == ours
    assert unset_options("host=h keepalives=0", ours) == {"keepalives_idle": 10, "tcp_user_timeout": 30_000}
    assert unset_options("postgresql://u@h/d?tcp_user_timeout=5000&keepalives_idle=2", ours) == {"keepalives": 1}
    assert unset_options("host='unterminated", ours) == ours  # connecting says what is wrong with it
    # connect_timeout is the same rule, with its environment variable
    assert connect_timeout("host=h", 5) == unset_options("host=h", {"connect_timeout": 5}) == {"connect_timeout": 5}
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "13")
    assert unset_options("host=h", {"connect_timeout": 5, **ours}) == ours
