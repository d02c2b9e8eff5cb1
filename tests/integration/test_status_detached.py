"""`outbox-relay status` on a partitioned outbox one of whose partitions a DBA detached.

Before: status counted the outbox's pending rows only; a detached partition's unpublished
rows, no longer in the outbox and never published, showed nowhere (the relay's cleanup
warns of them, status did not).  Now status names the table and how many it holds, flagged
as detached: not being published.  Under the least-privilege role, which may not read a
detached table, status still answers and says the rows were not counted."""

from __future__ import annotations

import json
import os
import subprocess

from tests.fixtures.outbox import relay_cmd
from tests.integration.test_least_privilege import login_role
from tests.integration.test_partition_detached import PUBLISHED, ROWS, _detach_a_coming_day
from tests.integration.test_pgbouncer import pgbouncer  # noqa: F401 - the fixture


def _status(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(relay_cmd("status", *args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUTBOX_RELAY_DSN": dsn}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    return done


def test_status_counts_a_detached_partitions_pending_rows_and_says_they_are_not_published(db_dsn):
    name = _detach_a_coming_day(db_dsn)
    report = json.loads(_status(db_dsn, "--json").stdout)
    assert report["pending"] == 0  # they left the outbox with the partition
    assert report["detached_pending"] == [{"table": name, "pending": ROWS - PUBLISHED, "readable": True}]
    lines = _status(db_dsn).stdout.splitlines()
    assert (f"detached rows:       {ROWS - PUBLISHED} unpublished rows in {name} (detached from the "
            "outbox: never published; attach it again or copy them into the outbox)") in lines


def test_status_under_the_relays_role_names_a_detached_partition_it_may_not_read(db_dsn):
    name = _detach_a_coming_day(db_dsn)
    with login_role(db_dsn) as login:
        report = json.loads(_status(login.dsn, "--json").stdout)
    assert report["detached_pending"] == [{"table": name, "pending": None, "readable": False}]


def test_status_counts_them_through_a_statement_pooler(db_dsn, pgbouncer):  # noqa: F811 - the fixture
    # status works through a statement-mode pooler (README): the count's bounded lock wait,
    # a transaction block, made it fail there ("transaction blocks not allowed"), exit 1.
    name = _detach_a_coming_day(db_dsn)
    report = json.loads(_status(pgbouncer("statement"), "--json").stdout)
    assert report["detached_pending"] == [{"table": name, "pending": ROWS - PUBLISHED, "readable": True}]
