"""The listener's failures in a row (:class:`consumer_sdk.jobs.wake.ListenFailures`): one line a
streak, again every LOG_EVERY_S with the count, its end once, the error masked (pure: no database)."""

from __future__ import annotations

from typing import Any

import structlog

from consumer_sdk.errors import DatabaseUnavailable
from consumer_sdk.jobs.wake import LOG_EVERY_S, ListenFailures

DOWN = DatabaseUnavailable("database unreachable: connection to postgresql://app:s3cret-pw@db:5432/app failed\n"
                           "\tIs the server running on that host?")


def _failures(logged: list[dict[str, Any]]) -> ListenFailures:
    def record(_logger: Any, level: str, event: dict[str, Any]) -> dict[str, Any]:
        logged.append({**event, "level": level})
        raise structlog.DropEvent

    return ListenFailures(structlog.wrap_logger(None, processors=[record]))


def test_a_streak_is_logged_at_its_first_failure_then_every_log_interval_and_its_end_once() -> None:
    logged: list[dict[str, Any]] = []
    failures = _failures(logged)
    now = 10.0
    for _ in range(6):  # every 5 s for 29 s: the back-off's ceiling
        failures.failed(DOWN, now)
        now += 5.0
    now -= 1.0  # 29 s after the first
    failures.failed(DOWN, now)
    assert [(e["event"], e["level"], e["failures"], e["failing_s"]) for e in logged] == [
        ("listen_failed", "warning", 1, 0.0)]
    failures.failed(DOWN, now + 1.0)  # 30 s: once more, with the count
    assert [(e["failures"], e["failing_s"]) for e in logged[1:]] == [(8, 30.0)]
    failures.listening(now + 3.0)
    failures.listening(now + 4.0)  # listening on: nothing more to say
    assert logged[2:] == [{"event": "listen_recovered", "level": "info", "failures": 8, "failed_s": 32.0}]
    failures.failed(DOWN, now + 100.0)  # the next streak is logged again, from its first failure
    assert [(e["event"], e["failures"]) for e in logged[3:]] == [("listen_failed", 1)]
    assert LOG_EVERY_S == 30.0


def test_the_error_is_its_first_line_masked() -> None:
    logged: list[dict[str, Any]] = []
    _failures(logged).failed(DOWN, 0.0)
    (line,) = logged
    assert "s3cret-pw" not in line["error"] and "***" in line["error"] and "\n" not in line["error"], line
    assert line["error_type"] == "DatabaseUnavailable"
