"""WorkerConfig.pool_statement_timeout_s (consumer_sdk/jobs/config.py): checked like the other
durations, 0 for none, sent to PostgreSQL in whole milliseconds (never 0 when set)."""

from __future__ import annotations

from typing import Any

import pytest

from consumer_sdk.jobs import WorkerConfig
from consumer_sdk.jobs.errors import InvalidJob

DSN = "postgresql://localhost/db"


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), 86_400.5, True, "5", None])
def test_pool_statement_timeout_s_is_checked(value: Any) -> None:
    with pytest.raises(InvalidJob, match="pool_statement_timeout_s"):
        WorkerConfig(dsn=DSN, pool_statement_timeout_s=value)


@pytest.mark.parametrize(("seconds", "ms"), [(20.0, 20_000), (0, 0), (0.0001, 1), (1.2345, 1234), (86_400, 86_400_000)])
def test_pool_statement_timeout_ms_is_whole_milliseconds_and_0_only_when_off(seconds: float, ms: int) -> None:
    assert WorkerConfig(dsn=DSN, pool_statement_timeout_s=seconds).pool_statement_timeout_ms == ms


def test_the_default_is_twenty_seconds() -> None:
    assert WorkerConfig(dsn=DSN).pool_statement_timeout_s == 20.0
