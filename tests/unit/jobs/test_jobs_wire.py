"""The fence's libpq pipeline (consumer_sdk._wire) leans on psycopg internals; when a
psycopg release drops them the fence falls back to psycopg's pipeline, and this says so."""

from __future__ import annotations

import psycopg

from consumer_sdk import _wire


def test_the_psycopg_internals_the_fence_uses_are_there() -> None:
    assert _wire.INTERNALS, f"psycopg {psycopg.__version__}: generators.send/fetch_many or Connection.wait changed"


def test_the_psycopg_internals_the_deferred_fence_uses_are_there() -> None:
    from consumer_sdk.jobs import deferred

    assert deferred.INTERNALS, (f"psycopg {psycopg.__version__}: fenced transactions fall back to three round "
                                f"trips; check the deferred fence against it (tested with {deferred.TESTED_PSYCOPG})")
