"""Commit order per key with concurrent writers and random commit delays (issue 3).

Writers of one key serialize on the key with a lock taken before their first write,
as services do when they lock the aggregate the event is about; writers of different
keys overlap freely and commit after random delays, so a row with a lower id often
commits after one with a higher id.  A pipelined relay that walked ids with a cursor
would step over such a row; ours batches by snapshot difference (the rows committed
between two claims), so every key's events reach Kafka in commit order.
"""

from __future__ import annotations

import json
import random
import threading
import time

import psycopg

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import RelayThread, all_event_ids, wait_drained
from tests.fixtures.procs import wait_until


class CommitLog:
    """The order in which writers saw their commits return."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: dict[int, int] = {}  # outbox id -> commit rank

    def add(self, ids: list[int]) -> None:
        with self.lock:
            for row_id in ids:
                self.order[row_id] = len(self.order)


def writer(dsn: str, topic: str, keys: list[str], rounds: int, seed: int, errors: list[BaseException],
           commits: CommitLog) -> None:
    rnd = random.Random(seed)
    try:
        with psycopg.connect(dsn) as conn:
            for _ in range(rounds):
                key = rnd.choice(keys)
                with conn.transaction():
                    # Lock the key before the first write: its sequence is its commit order.
                    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))
                    seq = conn.execute(
                        "INSERT INTO key_seq (key, seq) VALUES (%s, 1) ON CONFLICT (key) "
                        "DO UPDATE SET seq = key_seq.seq + 1 RETURNING seq", (key,)).fetchone()[0]
                    time.sleep(rnd.random() * 0.004)  # noqa: TID251 - the commit delay under test
                    # Unrelated filler rows get ids in between.
                    row_id = conn.execute(
                        "INSERT INTO outbox (topic, key, payload) VALUES (%s, %s, %s) RETURNING id",
                        (topic, key, json.dumps({"key": key, "seq": seq}))).fetchone()[0]
                    time.sleep(rnd.random() * 0.006)  # noqa: TID251 - the commit delay under test
                commits.add([row_id])
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)


def test_first_deliveries_follow_commit_order_under_concurrent_writers(outbox_db, broker, topic):
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE key_seq (key text PRIMARY KEY, seq int NOT NULL)")
    keys = [f"k{i}" for i in range(12)]
    errors: list[BaseException] = []
    commits = CommitLog()
    threads = [threading.Thread(target=writer, args=(outbox_db, topic, keys, 150, seed, errors, commits))
               for seed in range(8)]
    with RelayThread(outbox_db, broker.bootstrap, batch_size=50, poll_interval_s=0.05):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        wait_drained(outbox_db, timeout_s=60)
    expected = all_event_ids(outbox_db)
    assert len(expected) == 8 * 150
    records = read_all(broker.bootstrap, topic, expected=expected, timeout_s=60)
    seen: set[str] = set()
    last: dict[str, int] = {}
    violations = []
    for rec in records:
        event_id = rec.headers["event_id"].decode()
        if event_id in seen:
            continue
        seen.add(event_id)
        body = json.loads(rec.value)
        if body["seq"] != last.get(body["key"], 0) + 1:
            violations.append((body["key"], last.get(body["key"], 0), body["seq"]))
        last[body["key"]] = body["seq"]
    assert seen == expected
    assert violations == []  # every key's seq arrives as 1, 2, 3, ... with no gap or swap
    # The test means something only if rows committed out of id order, many times: each
    # such row is one an id cursor would have stepped over.
    by_rank = sorted(commits.order, key=commits.order.__getitem__)
    highest, late_low_ids = 0, 0
    for row_id in by_rank:
        if row_id < highest:
            late_low_ids += 1
        highest = max(highest, row_id)
    assert late_low_ids > 20, f"only {late_low_ids} rows committed behind a higher id"


def test_a_long_transaction_in_another_database_does_not_hold_the_relay_back(
        outbox_db, pg_server, broker, topic, request):
    """Transaction ids are cluster-wide; the horizon leaves out other databases' ones."""
    other = f"t_other_{abs(hash(request.node.name)) % 10**8}"
    other_dsn = pg_server.create_database(other)
    try:
        with psycopg.connect(other_dsn) as blocker:
            blocker.execute("CREATE TABLE t (x int)")
            blocker.execute("INSERT INTO t VALUES (1)")  # holds an xid until the end of the test
            with RelayThread(outbox_db, broker.bootstrap):
                with psycopg.connect(outbox_db, autocommit=True) as conn:
                    conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', '{}')",
                                 (topic,))
                wait_drained(outbox_db, timeout_s=15)
            blocker.rollback()
    finally:
        pg_server.drop_database(other)


def test_an_open_writer_holds_back_only_its_own_rows(outbox_db, broker, topic):
    """Batches by snapshot difference: a transaction left open holds back nothing but
    its own rows, which go out when it commits, after the rows of its key that
    committed first (commit order, not id or xid order)."""
    with RelayThread(outbox_db, broker.bootstrap, poll_interval_s=0.05):
        with psycopg.connect(outbox_db) as open_writer:
            open_writer.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', "
                                "'{\"seq\": 2}')", (topic,))  # lower id and xid, commits last
            with psycopg.connect(outbox_db, autocommit=True) as conn:
                conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', "
                             "'{\"seq\": 1}')", (topic,))
            wait_until(lambda: scalar_count(outbox_db) == 1, timeout_s=10,
                       message="the row committed after the open transaction began")
            open_writer.commit()
        wait_drained(outbox_db, timeout_s=15)
    seqs = [json.loads(r.value)["seq"] for r in read_all(broker.bootstrap, topic, expected=2,
                                                          timeout_s=30)]
    assert seqs == [1, 2]


def test_a_rolled_back_writer_leaves_nothing_behind(outbox_db, broker, topic):
    with RelayThread(outbox_db, broker.bootstrap, poll_interval_s=0.05):
        with psycopg.connect(outbox_db) as open_writer:
            open_writer.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', "
                                "'{\"seq\": 0}')", (topic,))
            with psycopg.connect(outbox_db, autocommit=True) as conn:
                conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', "
                             "'{\"seq\": 1}')", (topic,))
            wait_until(lambda: scalar_count(outbox_db) == 1, timeout_s=10,
                       message="the committed row")
            open_writer.rollback()
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', "
                         "'{\"seq\": 2}')", (topic,))
        wait_drained(outbox_db, timeout_s=15)
    seqs = [json.loads(r.value)["seq"] for r in read_all(broker.bootstrap, topic, expected=2,
                                                          timeout_s=30)]
    assert seqs == [1, 2]


def scalar_count(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
                   .fetchone()[0])


def unserialized_writer(dsn: str, topic: str, keys: list[str], rounds: int, seed: int,
                        errors: list[BaseException]) -> None:
    """Writers that do NOT serialize on the key: a key's rows may commit out of xid order.
    The commit order is recorded in the database: the last statement of each transaction
    takes one lock and a number from a sequence, and the lock is held until COMMIT."""
    rnd = random.Random(seed)
    try:
        with psycopg.connect(dsn) as conn:
            for _ in range(rounds):
                key = rnd.choice(keys)
                with conn.transaction():
                    row_id = conn.execute(
                        "INSERT INTO outbox (topic, key, payload) VALUES (%s, %s, '{}') RETURNING id",
                        (topic, key)).fetchone()[0]
                    time.sleep(rnd.random() * 0.05)  # noqa: TID251 - the commit delay under test
                    conn.execute("SELECT pg_advisory_xact_lock(42)")
                    conn.execute("INSERT INTO commit_log (row_id, rank) "
                                 "VALUES (%s, nextval('commit_rank'))", (row_id,))
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)


def test_unserialized_writers_are_delivered_in_commit_order_across_windows(outbox_db, broker, topic):
    """Per key, first deliveries follow commit order between claim windows; inside one
    window they follow (xid, id).  So a pair delivered against commit order must be in
    (xid, id) order, and pairs whose xid order differs from their commit order go out
    in commit order whenever a claim fell between their commits."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE commit_log (row_id bigint PRIMARY KEY, rank bigint NOT NULL)")
        conn.execute("CREATE SEQUENCE commit_rank")
    keys = [f"k{i}" for i in range(6)]
    errors: list[BaseException] = []
    threads = [threading.Thread(target=unserialized_writer,
                                args=(outbox_db, topic, keys, 60, seed, errors))
               for seed in range(8)]
    with RelayThread(outbox_db, broker.bootstrap, batch_size=50, poll_interval_s=0.05):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        wait_drained(outbox_db, timeout_s=60)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        info = {str(event_id): (key, int(xid), row_id, rank) for event_id, key, xid, row_id, rank in
                conn.execute("SELECT o.event_id, o.key, o.xid::text, o.id, c.rank "
                             "FROM outbox AS o JOIN commit_log AS c ON c.row_id = o.id")}
    assert len(info) == 8 * 60
    records = read_all(broker.bootstrap, topic, expected=set(info), timeout_s=60)
    delivered: dict[str, list[tuple[int, int, int]]] = {}
    seen: set[str] = set()
    for rec in records:
        event_id = rec.headers["event_id"].decode()
        if event_id not in seen:
            seen.add(event_id)
            key, xid, row_id, rank = info[event_id]
            delivered.setdefault(key, []).append((rank, xid, row_id))
    assert seen == set(info)
    against_both, xid_inverted, in_commit_order = [], 0, 0
    for key, rows in delivered.items():
        for i, (rank_a, xid_a, id_a) in enumerate(rows):
            for rank_b, xid_b, id_b in rows[i + 1:]:  # a delivered before b
                if rank_a > rank_b and (xid_a, id_a) > (xid_b, id_b):
                    against_both.append((key, id_a, id_b))
                if (rank_a < rank_b) != ((xid_a, id_a) < (xid_b, id_b)):
                    xid_inverted += 1
                    in_commit_order += rank_a < rank_b
    assert against_both == []
    assert xid_inverted > 20, f"only {xid_inverted} same-key pairs committed out of xid order"
    # An (xid, id) claim (the old horizon) delivers none of them in commit order; windows
    # of a few milliseconds deliver every pair whose commits a claim fell between.  How
    # many pairs a claim falls between is the machine's timing, not a guarantee: with two
    # test suites on the 2 cores it was 12 of 128 (a tenth, the bound this had, failed).
    assert in_commit_order >= 5, (in_commit_order, xid_inverted)
