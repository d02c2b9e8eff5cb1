"""The fencing rule, step by step with controlled time, on the real SQL (issue 3)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg

from relay.model import Cursor, Lease, ShardId, Token
from relay.store import Store
from tests.fixtures.outbox import insert_rows, migrated, scalar
from tests.fixtures.procs import wait_until

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(store: Store, seconds: float) -> Store:
    store.now = T0 + timedelta(seconds=seconds)
    return store


def test_a_late_writer_is_rejected_and_the_new_owner_is_accepted(db_dsn):
    dsn = migrated(db_dsn, shards=1)
    insert_rows(dsn, "orders", 4, keys=1)
    a, b = Store(dsn), Store(dsn)
    try:
        # t=0: A claims the only shard until t=10, token 1.
        assert at(a, 0).claim_shards(owner="A", limit=1, lease_s=10) == {ShardId(0): Token(1)}
        rows, _, _ = a.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=10)
        assert len(rows) == 4
        # t=5: B's claim is refused, the lease is live.
        assert at(b, 5).claim_shards(owner="B", limit=1, lease_s=10) == {}
        # t=11: A's lease expired; B claims with token 2.
        assert at(b, 11).claim_shards(owner="B", limit=1, lease_s=10) == {ShardId(0): Token(2)}
        # t=12: A's late mark is rejected: nothing changes, and A learns it lost the shard.
        held, marked = at(a, 12).mark_published(owner="A", leases=[Lease(ShardId(0), Token(1), 0)],
                                                rows=rows[:2])
        assert held == set() and marked == set()
        assert scalar(dsn, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL") == 0
        # A's renewal and release are rejected too.
        assert at(a, 12).heartbeat(owner="A", ttl_s=10, leases=[Lease(ShardId(0), Token(1), 0)],
                                   lease_s=10) == (1, {})
        assert a.release(owner="A", leases=[Lease(ShardId(0), Token(1), 0)]) == set()
        # A's dead-letter move and failure record are fenced as well.
        assert not a.dead_letter(owner="A", lease=Lease(ShardId(0), Token(1), 0), row=rows[0],
                                 reason="x", error="y")
        assert a.record_failure(owner="A", lease=Lease(ShardId(0), Token(1), 0), row=rows[0],
                                error="y", backoff_s=1) is None
        # B's mark with token 2 is accepted.
        held, marked = at(b, 12).mark_published(owner="B", leases=[Lease(ShardId(0), Token(2), 0)],
                                                rows=rows[:2])
        assert held == {ShardId(0)} and marked == {rows[0].id, rows[1].id}
        owner, token = scalar(dsn, "SELECT array[owner, token::text] FROM outbox_relay_shards")
        assert (owner, token) == ("B", "2")
    finally:
        a.close()
        b.close()


def test_one_heartbeat_statement_renews_each_lease_by_its_own_token_and_counts_replicas(db_dsn):
    """The heartbeat is one statement (issue 18's thirty-third pass): the replica's row,
    the renewals and the live count together, each renewed shard paired with its token."""
    dsn = migrated(db_dsn, shards=4)
    a, b = Store(dsn), Store(dsn)
    try:
        assert at(a, 0).claim_shards(owner="A", limit=3, lease_s=10) == {
            ShardId(0): Token(1), ShardId(1): Token(1), ShardId(2): Token(1)}
        assert at(b, 0).claim_shards(owner="B", limit=1, lease_s=10) == {ShardId(3): Token(1)}
        # B took shard 1 over (a new token); A's heartbeat still offers it, out of order.
        b.conn.execute("UPDATE outbox_relay_shards SET owner = 'B', token = 7 WHERE shard = 1")
        live, renewed = at(a, 5).heartbeat(owner="A", ttl_s=10, lease_s=20, leases=[
            Lease(ShardId(2), Token(1), 0), Lease(ShardId(0), Token(1), 0), Lease(ShardId(1), Token(1), 0)])
        assert live == 1 and renewed == {ShardId(0): Token(1), ShardId(2): Token(1)}
        live, renewed = at(b, 6).heartbeat(owner="B", ttl_s=10, lease_s=10, leases=[
            Lease(ShardId(1), Token(7), 0), Lease(ShardId(3), Token(1), 0)])
        assert live == 2 and renewed == {ShardId(1): Token(7), ShardId(3): Token(1)}
        until = dict(a.conn.execute(
            "SELECT shard, extract(epoch FROM lease_until - %s)::int FROM outbox_relay_shards", [T0]).fetchall())
        assert until == {0: 25, 1: 16, 2: 25, 3: 16}
        # No leases: the replica is still announced and counted.
        assert at(b, 7).heartbeat(owner="C", ttl_s=10, lease_s=10, leases=[]) == (3, {})
        assert scalar(dsn, "SELECT count(*) FROM outbox_relay_replicas") == 3
    finally:
        a.close()
        b.close()


def test_a_takeover_waits_for_an_in_progress_mark(db_dsn):
    """The mark takes FOR SHARE on the lease row: a takeover cannot slip in between the
    mark's check and its commit."""
    dsn = migrated(db_dsn, shards=1)
    insert_rows(dsn, "orders", 1, keys=1)
    a = Store(dsn)
    try:
        at(a, 0).claim_shards(owner="A", limit=1, lease_s=10)
        rows, _, _ = a.claim(shards=[ShardId(0)], nshards=1, after=Cursor(), limit=10)
        with psycopg.connect(dsn) as blocker:  # A's mark, held open in a transaction
            from relay.queries import compose, query

            blocker.execute(compose("relay", "mark_published"), {
                "owner": "A", "held_shards": [0], "held_tokens": [1], "ids": [rows[0].id],
                "row_shards": [0], "now": T0 + timedelta(seconds=1)})
            with psycopg.connect(dsn, autocommit=True) as b:
                b.execute("SET lock_timeout = '300ms'")
                try:
                    b.execute(query("leases", "claim_shards"), {
                        "owner": "B", "limit": 1, "lease_s": 10, "now": T0 + timedelta(seconds=11),
                        "reclaim": False, "held": "{}"})
                    claimed = b.execute("SELECT owner FROM outbox_relay_shards").fetchone()
                except psycopg.errors.LockNotAvailable:
                    claimed = None
            # The takeover skipped the locked lease row (SKIP LOCKED) instead of stealing it.
            assert claimed == ("A",) or claimed is None
    finally:
        a.close()


def test_a_restarted_process_of_the_same_name_resumes_its_leases_at_once_unless_one_lives(db_dsn):
    # A container restarted in its pod keeps its owner name (host name and pid 1).  Its new
    # process takes the old one's leases at once, with new tokens, when no live session
    # holds the name's advisory lock; never while one does (a paused process, or two
    # relays given one --owner), and never shards this process holds itself.
    dsn = migrated(db_dsn, shards=4)
    old, new, other = Store(dsn), Store(dsn), Store(dsn)
    try:
        assert at(old, 0).claim_shards(owner="pod-1", limit=2, lease_s=10, held=[]) == {
            ShardId(0): Token(1), ShardId(1): Token(1)}
        # The old process lives (its connection holds the name's lock): nothing reclaimed,
        # only the free shards.
        assert at(new, 1).claim_shards(owner="pod-1", limit=4, lease_s=10, held=[]) == {
            ShardId(2): Token(1), ShardId(3): Token(1)}
        # A claim that does not ask to reclaim never does.
        old_pid = old.conn.info.backend_pid
        old.close()
        # The server ends the closed session (and drops its lock) a moment after the client
        # closed it: a claim in that moment still found the name's lock held (CI, 8065f67).
        wait_until(lambda: not scalar(dsn, "SELECT count(*) FROM pg_stat_activity WHERE pid = %(pid)s",
                                      {"pid": old_pid}), timeout_s=10,
                   message="the old process's session did not end")
        assert at(other, 2).claim_shards(owner="pod-1", limit=4, lease_s=10) == {}
        # The old process is gone with its connection: the new one takes its leases now (not
        # at t=10), with new tokens, and leaves the ones it holds alone.
        assert at(new, 2).claim_shards(owner="pod-1", limit=4, lease_s=10, held=[ShardId(2), ShardId(3)]) == {
            ShardId(0): Token(2), ShardId(1): Token(2)}
        tokens = dict(new.conn.execute("SELECT shard, token FROM outbox_relay_shards").fetchall())
        assert tokens == {0: 2, 1: 2, 2: 1, 3: 1}
        # The old process's late writes are fenced by the new tokens.
        assert old.heartbeat(owner="pod-1", ttl_s=10, leases=[Lease(ShardId(0), Token(1), 0)],
                             lease_s=10)[1] == {}
        # Another owner's live leases are never taken this way.
        assert at(other, 3).claim_shards(owner="pod-2", limit=4, lease_s=10, held=[]) == {}
    finally:
        old.close()
        new.close()
        other.close()
