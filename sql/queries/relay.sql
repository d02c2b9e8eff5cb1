-- Named queries of the relay.  Each block starts with "-- name: <name>" and is
-- loaded once by relay/queries.py.  Parameters are psycopg named placeholders;
-- {table} is the outbox (or a mapped view of another table, see sql/adopt/),
-- composed with psycopg.sql.Identifier.
-- %(now)s is NULL in production (the database clock is the reference for leases)
-- and a fixed timestamp in tests that control time.

-- name: claim_batch
-- Pending rows of the shards this replica holds, in (xid, id) order, only from
-- transactions older than every transaction still in flight (so nothing that
-- commits later can sort before them), after the pipelining cursor.
-- Transaction ids are cluster-wide, so "in flight" leaves out what provably cannot
-- write this outbox: transactions of backends connected to other databases, and
-- autovacuum workers (their ANALYZE holds an xid for a while), and the relay's own
-- mark connection (%(mark_pid)s: it only marks rows, never inserts).  A role that may not
-- see them in pg_stat_activity (no pg_read_all_stats) simply waits for them: safe,
-- slower.  Prepared transactions have no backend and are always waited for.
-- A row in back-off, and every later row of its key, waits.
-- No row locks: shard leases give exclusivity, and SKIP LOCKED would let a
-- replica step over a row that a stale owner had locked and publish the key's
-- next row first.
WITH snap AS (
    SELECT pg_current_snapshot() AS s
), horizon AS (
    SELECT coalesce(
        (SELECT min(x) FROM snap, pg_snapshot_xip(snap.s) AS x
         WHERE x::xid NOT IN (
             SELECT a.backend_xid FROM pg_stat_activity AS a
             WHERE a.backend_xid IS NOT NULL
               AND (a.backend_type = 'autovacuum worker' OR a.pid = %(mark_pid)s
                    OR a.datid IS DISTINCT FROM (SELECT d.oid FROM pg_database AS d
                                                 WHERE d.datname = current_database())))),
        (SELECT pg_snapshot_xmax(s) FROM snap)) AS h
)
SELECT o.id, o.event_id::text AS event_id, o.topic, o.key,
       o.payload::text AS payload_text, o.payload_bytes, o.headers::text AS headers_text,
       o.xid::text AS xid, o.attempts,
       (hashtext(coalesce(o.key, o.event_id::text)) & 2147483647) %% %(nshards)s AS shard,
       extract(epoch FROM o.created_at)::float8 AS created_epoch
FROM {table} AS o
WHERE o.published_at IS NULL
  AND o.xid < (SELECT h FROM horizon)
  AND (o.xid, o.id) > (%(after_xid)s::xid8, %(after_id)s::bigint)
  AND (%(all_shards)s OR (hashtext(coalesce(o.key, o.event_id::text)) & 2147483647) %% %(nshards)s = ANY(%(shards)s::int[]))
  AND (o.retry_at IS NULL OR o.retry_at <= coalesce(%(now)s::timestamptz, now()))
  AND (o.key IS NULL OR NOT EXISTS (
      SELECT 1 FROM {table} AS b
      WHERE b.published_at IS NULL AND b.retry_at IS NOT NULL
        AND b.retry_at > coalesce(%(now)s::timestamptz, now())
        AND b.key = o.key
        AND (b.xid, b.id) < (o.xid, o.id)))
ORDER BY o.xid, o.id
LIMIT %(limit)s

-- name: mark_published
-- Fenced: rows are marked only in shards whose lease this owner still holds with
-- the same token.  FOR SHARE on the lease rows makes a concurrent takeover wait
-- for this transaction (or makes this one see the new token and mark nothing).
WITH held AS (
    SELECT s.shard
    FROM outbox_relay_shards AS s
    JOIN unnest(%(held_shards)s::int[], %(held_tokens)s::bigint[]) AS h(shard, token)
      ON h.shard = s.shard AND h.token = s.token
    WHERE s.owner = %(owner)s
    FOR SHARE OF s
), marked AS (
    UPDATE {table} AS o
    SET published_at = coalesce(%(now)s::timestamptz, now()), retry_at = NULL
    FROM unnest(%(ids)s::bigint[], %(row_shards)s::int[]) AS r(id, shard)
    WHERE o.id = r.id
      AND o.published_at IS NULL
      AND r.shard IN (SELECT shard FROM held)
    RETURNING o.id
)
SELECT (SELECT coalesce(array_agg(shard), ARRAY[]::int[]) FROM held) AS held,
       (SELECT coalesce(array_agg(id), ARRAY[]::bigint[]) FROM marked) AS marked

-- name: record_failure
-- Fenced like mark_published: counts an attempt, keeps the broker's message and
-- schedules the retry.
WITH held AS (
    SELECT s.shard
    FROM outbox_relay_shards AS s
    WHERE s.shard = %(shard)s AND s.token = %(token)s AND s.owner = %(owner)s
    FOR SHARE OF s
)
UPDATE {table} AS o
SET attempts = o.attempts + 1,
    last_error = %(error)s,
    retry_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(backoff_s)s)
WHERE o.id = %(id)s AND o.published_at IS NULL AND EXISTS (SELECT 1 FROM held)
RETURNING o.attempts

-- name: dead_letter
-- Fenced move of one row to the dead letters, in one statement: never in both
-- places, never in neither.
WITH held AS (
    SELECT s.shard
    FROM outbox_relay_shards AS s
    WHERE s.shard = %(shard)s AND s.token = %(token)s AND s.owner = %(owner)s
    FOR SHARE OF s
), moved AS (
    DELETE FROM {table} AS o
    WHERE o.id = %(id)s AND o.published_at IS NULL AND EXISTS (SELECT 1 FROM held)
    RETURNING o.*
)
INSERT INTO outbox_dead_letters
    (id, event_id, topic, key, payload, payload_bytes, headers, created_at,
     reason, error, attempts, owner)
SELECT id, event_id, topic, key, payload, payload_bytes, headers, created_at,
       %(reason)s, %(error)s, attempts + 1, %(owner)s
FROM moved
RETURNING id

-- name: backlog
-- One cheap query for the pending gauges (run on a timer, not per batch).
SELECT count(*) AS pending,
       coalesce(extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - min(created_at)), 0)::float8
           AS oldest_age_s,
       count(*) FILTER (WHERE retry_at IS NOT NULL) AS retrying
FROM {table}
WHERE published_at IS NULL

-- name: schema_check
SELECT to_regclass(%(table)s) IS NOT NULL AS has_outbox,
       to_regclass('outbox_relay_shards') IS NOT NULL AS has_shards,
       to_regclass('outbox_relay_settings') IS NOT NULL AS has_settings

-- name: read_settings
SELECT shards FROM outbox_relay_settings

-- name: async_commit
-- The relay's own writes (marks, lease renewals, dead-letter moves) commit without
-- waiting for the WAL flush: losing one to a database crash means a redelivery or
-- a fenced write, never a lost row.
SET synchronous_commit = off

-- name: listen
LISTEN outbox_relay

-- name: go_to_sleep
-- On the LISTEN connection: false when writers are mid-transaction or another
-- relay already sleeps (see sql/migrations/0003_notify.sql).
SELECT pg_try_advisory_lock(7263740001) AS sleeping

-- name: wake_up
SELECT pg_advisory_unlock(7263740001) AS released
