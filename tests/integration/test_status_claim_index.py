"""`outbox-relay status` names the claim's index, and says (as the relay at start does) when
it is not the one migrate keeps.

Before: nothing told an SRE which index served the claim.  After a major upgrade to
PostgreSQL 17 (the shard column's index is built at migrate's next run), a --shards change,
or a concurrent build migrate gave up on (an invalid index, relay/migrate_index.py), the
claim went on, correct and dearer, and status showed the same as when all was well."""

from __future__ import annotations

import json

import psycopg

from relay import migrate
from tests.fixtures.outbox import relay_cmd, relay_env
from tests.integration.test_least_privilege import login_role
from tests.integration.test_pending_index import _the_other_index
from tests.integration.test_pending_index_concurrently import given_up_build
from tests.integration.test_status_detached import _status


def test_status_names_the_claim_index_and_says_when_migrate_has_one_to_build(db_dsn):
    migrate.apply(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        kept = migrate.claim_index(conn.info.server_version, migrate.DEFAULT_SHARDS)
    report = json.loads(_status(db_dsn, "--json").stdout)
    assert report["claim_index"] == {"expected": kept, "found": [{"name": kept, "valid": True}], "ok": True}
    assert f"claim index:         {kept}" in _status(db_dsn).stdout.splitlines()

    _the_other_index(db_dsn)  # as an outbox from before the shard column stands on 17
    other = migrate.XID_ID_INDEX if kept != migrate.XID_ID_INDEX else migrate.pending_index(16)
    with login_role(db_dsn) as login:  # the relay's least-privilege role reads it too
        report = json.loads(_status(login.dsn, "--json").stdout)
    assert report["claim_index"] == {"expected": kept, "found": [{"name": other, "valid": True}], "ok": False}
    [line] = [x for x in _status(db_dsn).stdout.splitlines() if x.startswith("claim index:")]
    assert line == (f"claim index:         {other}; this server and shard count take {kept}: run "
                    "`outbox-relay migrate` (it builds it without holding writers on a large outbox); the "
                    "claim is correct meanwhile")


def test_status_says_a_concurrent_build_did_not_finish(db_dsn):
    kept, _ = given_up_build(db_dsn)
    report = json.loads(_status(db_dsn, "--json").stdout)["claim_index"]
    assert report["ok"] is False and {"name": kept, "valid": False} in report["found"], report
    [line] = [x for x in _status(db_dsn).stdout.splitlines() if x.startswith("claim index:")]
    assert f"{kept} (invalid: a concurrent build that did not finish)" in line, line
    migrate.apply(db_dsn)
    assert json.loads(_status(db_dsn, "--json").stdout)["claim_index"]["ok"] is True


def test_the_relay_says_at_start_when_migrate_has_a_claim_index_to_build(outbox_db, broker, spawn):
    """A major upgrade to PostgreSQL 17 leaves 0001's index until migrate runs again, and a
    relay restarted on the new server said nothing of it: a warning at each start now."""
    kept = _the_other_index(outbox_db)
    relay = spawn(relay_cmd("run"), env=relay_env(outbox_db, broker.bootstrap, owner="pod-a"), name="pod-a")
    relay.wait_for_log("relay_started", timeout_s=60)
    [line] = [json.loads(x) for x in relay.log_text().splitlines() if '"claim_index_not_built"' in x]
    assert f"this server and shard count take {kept}: run `outbox-relay migrate`" in line["detail"], line
    relay.sigterm()
    assert relay.wait(30) == 0
    migrate.apply(outbox_db)
    again = spawn(relay_cmd("run"), env=relay_env(outbox_db, broker.bootstrap, owner="pod-b"), name="pod-b")
    again.wait_for_log("relay_started", timeout_s=60)
    assert "claim_index_not_built" not in again.log_text()
    again.sigterm()
    assert again.wait(30) == 0
