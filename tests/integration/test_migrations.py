"""`migrate --print` is what `migrate` does: a team running the printed script with its own
tool gets the same schema, for both layouts."""

from __future__ import annotations

import uuid

import psycopg
import psycopg.errors
import pytest

from relay import migrate

CATALOG = """
SELECT 'column' AS kind, table_name || '.' || column_name || ' ' || data_type || ' ' ||
       is_nullable || ' ' || coalesce(column_default, '') || ' ' || is_identity AS item
FROM information_schema.columns WHERE table_schema = 'public'
UNION ALL
SELECT 'index', indexdef FROM pg_indexes WHERE schemaname = 'public'
UNION ALL
SELECT 'constraint', conrelid::regclass::text || ' ' || conname || ' ' || pg_get_constraintdef(oid)
FROM pg_constraint WHERE connamespace = 'public'::regnamespace
UNION ALL
SELECT 'trigger', tgrelid::regclass::text || ' ' || pg_get_triggerdef(oid)
FROM pg_trigger WHERE NOT tgisinternal
UNION ALL
SELECT 'function', p.proname || ' ' || md5(p.prosrc)
FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
UNION ALL
SELECT 'shards', count(*)::text FROM outbox_relay_shards
ORDER BY 1, 2
"""


def catalog(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(k, v) for k, v in conn.execute(CATALOG)
                if "outbox_schema_migrations" not in v and "outbox_p2" not in v]  # daily partitions: made by the relay


@pytest.mark.parametrize("partitioned", [False, True])
def test_printed_script_gives_the_same_schema_as_migrate(pg_server, request, partitioned):
    names = [f"t_mig_{'p' if partitioned else 'n'}_{i}_{abs(hash(request.node.name)) % 10**6}"
             for i in (1, 2)]
    dsns = [pg_server.create_database(name) for name in names]
    try:
        migrate.apply(dsns[0], partitioned=partitioned)
        with psycopg.connect(dsns[1], autocommit=True) as conn:
            conn.execute(migrate.render(partitioned=partitioned).encode())
        applied, printed = catalog(dsns[0]), catalog(dsns[1])
        assert applied == printed
        assert any(kind == "trigger" for kind, _ in applied)
    finally:
        for name in names:
            pg_server.drop_database(name)


@pytest.mark.parametrize("partitioned", [False, True])
def test_new_rows_get_time_ordered_event_ids(db_dsn, partitioned):
    """0009: the column default makes version 7 UUIDs (uuidv7() on PostgreSQL 18, the same
    layout built from gen_random_uuid() before it), in the order the rows were written;
    the file applies twice without harm."""
    migrate.apply(db_dsn, partitioned=partitioned)
    [v7] = [m for m in migrate.migrations(partitioned=partitioned) if m.name == "event_id_v7"]
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(v7.sql.encode())  # idempotent
        version = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()[0]
        body = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'outbox_uuid_v7'").fetchone()[0]
        stamps, ids = [], []
        for n in range(5):
            conn.execute("SELECT pg_sleep(0.002)")  # ids of different milliseconds
            stamps.append(conn.execute("SELECT clock_timestamp()").fetchone()[0])
            ids.append(conn.execute("INSERT INTO outbox (topic, key, payload) VALUES ('t.v7', %s, '{}') "
                                    "RETURNING event_id", (str(n),)).fetchone()[0])
        stamps.append(conn.execute("SELECT clock_timestamp()").fetchone()[0])
    assert ("uuidv7" in body) == (version >= 180000)
    assert [(u.version, u.variant) for u in ids] == [(7, uuid.RFC_4122)] * 5
    millis = [int(u.hex[:12], 16) for u in ids]
    assert millis == sorted(millis) and len(set(millis)) == 5
    # Each id's time lies between the clock readings taken around its insert.
    for n, ms in enumerate(millis):
        assert int(stamps[n].timestamp() * 1000) <= ms <= int(stamps[n + 1].timestamp() * 1000) + 1


def test_the_name_checks_are_validated_and_have_no_counted_repetition(db_dsn):
    """0010/0011: Kafka's topic rule and the jobs' queue rule without '{1,249}' / '{1,64}'
    (the regex engine expands them into a state per count: 13.7 and 3.7 us on every
    insert and every update of a row), validated against rows that were there before,
    which stay."""
    later = [m for m in migrate.migrations() if m.version >= 10]
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        for m in migrate.migrations():  # up to 0009 by hand, then rows, then the rest
            if m.version < 10:
                with conn.transaction():
                    conn.execute(m.sql.encode())
        conn.execute("INSERT INTO outbox (topic, payload) SELECT 't.' || g, '{}' FROM generate_series(1, 50) AS g")
        conn.execute("INSERT INTO jobs (queue, kind, owner_id, payload) "
                     "SELECT 'q:' || g, 'k', 'o', '{}' FROM generate_series(1, 50) AS g")
        for m in later + later:  # twice: idempotent
            with conn.transaction():
                conn.execute(m.sql.encode())
        checks = dict(conn.execute(
            "SELECT conname, (pg_get_constraintdef(oid), convalidated) FROM pg_constraint "
            "WHERE conname IN ('outbox_topic_valid', 'jobs_queue_valid')").fetchall())
        assert conn.execute("SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM jobs)").fetchone() == (50, 50)
        # The queue rule's edges (the topic's are in test_relay_e2e.py).
        for queue in ("q" * 64, "a", "bulk:eu-1.v2_x"):
            conn.execute("INSERT INTO jobs (queue, kind, owner_id, payload) VALUES (%s, 'k', 'o', '{}')", (queue,))
        for queue in ("q" * 65, "", "a b", "tâche", "a/b"):
            with pytest.raises(psycopg.errors.CheckViolation, match="jobs_queue_valid"):
                conn.execute("INSERT INTO jobs (queue, kind, owner_id, payload) VALUES (%s, 'k', 'o', '{}')",
                             (queue,))
    (topic, topic_valid), (queue, queue_valid) = checks["outbox_topic_valid"], checks["jobs_queue_valid"]
    assert topic_valid and queue_valid, checks
    assert "{" not in topic and "length(topic) <= 249" in topic, topic
    assert "{" not in queue and "length(queue) <= 64" in queue, queue


UNIQUE_INDEXES = """
SELECT c.oid::regclass::text AS name, coalesce(c.reloptions, '{}') AS options, pg_relation_size(c.oid) AS bytes
FROM pg_class AS c
WHERE c.oid IN ('outbox_pkey'::regclass, 'outbox_event_id_unique'::regclass)
   OR c.oid IN (SELECT inhrelid FROM pg_inherits
                WHERE inhparent IN ('outbox_pkey'::regclass, 'outbox_event_id_unique'::regclass))
ORDER BY 1
"""


@pytest.mark.parametrize("partitioned", [False, True])
def test_the_relays_marks_find_room_in_the_unique_indexes(db_dsn, partitioned):
    """0015: a mark is not a HOT update, so it adds an entry for each row's new version to the
    primary key and to event_id's index, next to the pending version's.  With leaves left 50 %
    full where ascending inserts split them, a backlog's marks split none: the indexes do not
    grow.  At PostgreSQL's default (90 %) the same marks nearly doubled them (the primary key
    456 -> 896 kB, event_id's 632 -> 1,240 kB, on the migrations before 0015): every leaf
    they wrote into was split, after a bottom-up deletion that found nothing to delete.  On a partitioned outbox, each partition's indexes get the room: those
    that exist at the migration (the default partition) and those the relay creates."""
    from relay.model import Cursor, Lease, ShardId, Token
    from relay.store import Store

    migrate.apply(db_dsn, partitioned=partitioned)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(migrate.migrations(partitioned=partitioned)[-1].sql.encode())  # idempotent
        conn.execute("INSERT INTO outbox (topic, key, payload) "
                     "SELECT 't.room', 'k' || (g % 100), jsonb_build_object('n', g) "
                     "FROM generate_series(1, 20000) AS g")
        before = conn.execute(UNIQUE_INDEXES).fetchall()
    names = [name for name, _, _ in before]
    if partitioned:  # the default partition's (the migration's) and today's (the relay's)
        assert any(n.startswith("outbox_default") for n in names), names
        assert any(n.startswith("outbox_p2") for n in names), names
    else:
        assert names == ["outbox_event_id_unique", "outbox_pkey"], names
    for name, options, _ in before:
        if name not in ("outbox_pkey", "outbox_event_id_unique") or not partitioned:
            assert "fillfactor=50" in options, (name, options)

    store = Store(db_dsn)
    try:
        held = store.claim_shards(owner="room", limit=1 << 16, lease_s=600)
        leases = [Lease(ShardId(s), Token(t), 1e18) for s, t in held.items()]
        shards = sorted(ShardId(s) for s in held)
        cursor, marked = Cursor(), 0
        while True:
            rows, snapshot, _ = store.claim(shards=shards, nshards=len(shards), after=cursor, limit=1000)
            if not rows:
                break
            cursor = cursor.advanced(rows[-1], snapshot or cursor.cur)
            marked += len(store.mark_published(owner="room", leases=leases, rows=rows)[1])
    finally:
        store.close()
    assert marked == 20000
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        after = conn.execute(UNIQUE_INDEXES).fetchall()
    # At most the rightmost leaf's split (it is never split at the fillfactor before the marks).
    grown = {name: (b, a) for (name, _, b), (_, _, a) in zip(before, after, strict=True)
             if a > b + 2 * 8192}
    assert not grown, grown
