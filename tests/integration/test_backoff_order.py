"""A row in back-off holds every later row of its key until a full pass sends it first,
also once its retry time has passed (README, "Ordering").

The claim's per-key probe asked only for rows whose retry was still ahead (``retry_at >
now``). Once a row's retry time passed it stopped holding its key, but a window's claim
never takes it either (it committed below the window): only a full pass ("nothing
seen") does. Between the two, the window's claims sent the key's newer rows ahead of it.
The replica that scheduled the retry starts that pass when the retry is due and nothing
is in flight; a replica that took the shard over, or a relay restarted while the row
waited, does not know the retry time and waits for the periodic pass, every 10 s or
more.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import psycopg

from relay.model import START, Cursor, ShardId
from relay.store import Store
from tests.fixtures.broker import read_all
from tests.fixtures.outbox import RelayThread, scalar, wait_drained
from tests.fixtures.procs import wait_until

ALL = [ShardId(0)]


def _insert(dsn: str, key: str, n: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("INSERT INTO outbox (topic, key, payload) VALUES ('t', %s, %s) RETURNING id",
                           (key, f'{{"n": {n}}}')).fetchone()
    assert row is not None
    return int(row[0])


def _claim(store: Store, cursor: Cursor, *, sent: tuple[int, ...] = ()) -> tuple[list[int], Cursor]:
    """One claim of every shard from ``cursor``; the ids and the cursor the relay moves to
    (the window's end when it was drained, as the pump does)."""
    rows, snapshot, _ = store.claim(shards=ALL, nshards=1, after=cursor, limit=1000, sent_retries=sent)
    window = snapshot if snapshot is not None else cursor.cur
    return [r.id for r in rows], Cursor.after_snapshot(window)


def test_a_due_row_in_back_off_holds_its_key_until_a_full_pass_sends_it_first(outbox_db):
    first = _insert(outbox_db, "k", 1)
    other = _insert(outbox_db, "other", 1)
    store = Store(outbox_db)
    try:
        # Another replica (or this relay before a restart) tried it and scheduled a retry.
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("UPDATE outbox SET attempts = 1, retry_at = now() + interval '1 hour' "
                         "WHERE id = %s", (first,))
        ids, cursor = _claim(store, START)  # this relay's full pass: the row waits
        assert ids == [other]
        second = _insert(outbox_db, "k", 2)
        ids, cursor = _claim(store, cursor)
        assert ids == [], "a row of a key with a row in back-off went out"

        # The retry time passes (the store's clock, as the relay's tests move it).
        store.now = datetime.now(UTC) + timedelta(hours=2)
        third = _insert(outbox_db, "k", 3)
        unrelated = _insert(outbox_db, "other", 2)
        ids, cursor = _claim(store, cursor)
        assert ids == [unrelated], (
            f"the window sent {ids}: key k's row {third} ahead of its earlier rows {first} and {second}")

        ids, _ = _claim(store, START)  # the full pass (nothing was marked here): k's rows in order
        assert [i for i in ids if i in (first, second, third)] == [first, second, third]
    finally:
        store.close()


def test_a_row_in_back_off_does_not_hold_its_key_inside_the_pass_that_sends_it(outbox_db):
    """The full pass takes a due row and the later rows of its key in one claim, in order;
    after it, the key's newer rows wait only while the relay has not sent that row (it
    stays in back-off until its mark)."""
    first = _insert(outbox_db, "k", 1)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET attempts = 1, retry_at = now() - interval '1 second' "
                     "WHERE id = %s", (first,))
    second = _insert(outbox_db, "k", 2)
    store = Store(outbox_db)
    try:
        ids, cursor = _claim(store, START)
        assert ids == [first, second]
        third = _insert(outbox_db, "k", 3)
        ids, _ = _claim(store, cursor)
        assert ids == []  # claimed, not sent (its key held, a lease near its end): k waits
        ids, _ = _claim(store, cursor, sent=(first,))
        assert ids == [third]  # sent, not yet marked: k's newer rows follow it
    finally:
        store.close()


def test_a_relay_that_did_not_schedule_a_retry_keeps_its_keys_order(outbox_db, broker, topic):
    """End to end, with a real relay and broker: a row put in back-off before this relay
    started (by another replica, or by this relay before a restart) becomes due while the
    relay runs, and a row of its key committed after that must not overtake it. On the code
    before, the newer row went out at once and the two older ones at the periodic full pass
    (10 s after the start), after it. The relay reads the retry time at its start-up pass
    and sends the key's rows, in order, at that time."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        def write(seq: int) -> int:
            row = conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', %s) RETURNING id",
                               (topic, json.dumps({"seq": seq}))).fetchone()
            assert row is not None
            return int(row[0])

        first = write(1)
        due = conn.execute("UPDATE outbox SET attempts = 1, last_error = 'unknown_topic: earlier', "
                           "retry_at = now() + interval '3 seconds' WHERE id = %s RETURNING retry_at",
                           (first,)).fetchone()[0]  # type: ignore[index]
        with RelayThread(outbox_db, broker.bootstrap):
            write(2)  # behind the row in back-off
            wait_until(lambda: scalar(outbox_db, "SELECT now() > %(due)s::timestamptz", {"due": due}),
                       timeout_s=10, message="the retry time did not pass")
            write(3)  # after the retry time: still behind it
            wait_drained(outbox_db, timeout_s=60)
    records = read_all(broker.bootstrap, topic, expected=3, timeout_s=30)
    assert [json.loads(r.value)["seq"] for r in records] == [1, 2, 3]
    # Sent at its retry time, not at the periodic pass about 7 s after it.
    late = scalar(outbox_db, "SELECT extract(epoch FROM max(published_at) - %(due)s::timestamptz) FROM outbox",
                  {"due": due})
    assert late < 4.0, f"the key's rows went {late:.1f} s after the retry time"


def test_the_next_retry_is_read_for_the_shards_held(outbox_db):
    """Store.sweep: seconds until the earliest row in back-off of the shards given is
    due; rows due already, and rows of other shards, do not count."""
    # A key in each of the 4 shards, so that each row's shard holds it alone.  (Keys a, b, c
    # and d put two rows in one shard, and the checks of one shard below never ran.)
    keys = [str(k) for k in scalar(outbox_db, "SELECT array_agg(k ORDER BY shard) FROM ("
                                   "  SELECT DISTINCT ON (shard) k, shard FROM ("
                                   "    SELECT 'k' || n AS k, mod(hashtext('k' || n) & 2147483647, 4) AS shard"
                                   "    FROM generate_series(1, 100) AS n) AS c"
                                   "  ORDER BY shard, k) AS one")]
    rows = [_insert(outbox_db, key, n) for n, key in enumerate(keys)]
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        shard = dict(conn.execute("SELECT id, (hashtext(coalesce(key, event_id::text)) & 2147483647) % 4 "
                                  "FROM outbox").fetchall())
        assert sorted(shard.values()) == [0, 1, 2, 3]
        for row_id, ahead_s in zip(rows, (30, 60, -5, 90), strict=True):
            conn.execute("UPDATE outbox SET attempts = 1, retry_at = now() + make_interval(secs => %s) "
                         "WHERE id = %s", (ahead_s, row_id))
    store = Store(outbox_db)

    def due_in(shards: list[int]) -> float | None:
        restamped, due = store.sweep(shards=[ShardId(s) for s in shards], nshards=4)
        assert restamped == 0  # the same statement restamps foreign xids: none here
        return due

    try:
        everything = due_in(list(range(4)))
        assert everything is not None and 28 < everything <= 30
        alone = due_in([shard[rows[3]]])  # the 90 s row's
        assert alone is not None and 88 < alone <= 90
        pair = due_in([shard[rows[1]], shard[rows[3]]])
        assert pair is not None and 58 < pair <= 60
        assert due_in([shard[rows[2]]]) is None  # due already
        assert due_in([]) is None
    finally:
        store.close()
