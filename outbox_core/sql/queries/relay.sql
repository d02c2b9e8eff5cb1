-- Named queries of the relay.  Each block starts with "-- name: <name>" and is
-- loaded once by relay/queries.py.  Parameters are psycopg named placeholders;
-- {table} is the outbox (or a mapped view of another table, see sql/adopt/),
-- composed with psycopg.sql.Identifier.
-- %(now)s is NULL in production (the database clock is the reference for leases)
-- and a fixed timestamp in tests that control time.

-- name: claim_batch
-- Pending rows of the shards this replica holds that committed inside the claim's
-- window, in (xid, id) order after the window's position, as PgQ batches events:
-- the window is the rows visible in snapshot %(cur)s (NULL: take the current one
-- now; it is returned as one more row) and not visible in the previous
-- window's snapshot, given as its xmax (%(prev_xmax)s) and the ids of the
-- transactions it saw in flight (%(prev_xip)s); nothing seen yet is xmax 0, no xip.
-- Not visible in that snapshot means: in flight then (one of prev_xip, a few index
-- lookups) or started after it (xid >= prev_xmax, a range of the pending index), so
-- a transaction held open elsewhere never holds a claim back, and the dead index
-- entries of rows marked since it began are never walked.  The first branch's xids
-- are all below prev_xmax, so the two branches in turn are (xid, id) order.
-- A row in back-off, and every later row of its key, waits, also once its retry is due:
-- a window's claim never takes such a row (it committed below the window), only a full
-- pass does, and the key's later rows wait for that pass to send it first.  It stops
-- holding them inside the claim that takes it (in the claim's range: after the position
-- and not visible in the previous snapshot) and once this relay has sent it since its
-- last full pass (%(sent_retries)s: its id until its mark clears retry_at).  Whether any
-- row is in back-off is asked once per claim (an InitPlan on the tiny retrying index):
-- when none is, as nearly always, no row pays the per-key probe (13 % of a 1,000-row claim).
-- No row locks: shard leases give exclusivity, and SKIP LOCKED would let a
-- replica step over a row that a stale owner had locked and publish the key's
-- next row first.
WITH cur AS MATERIALIZED (
    SELECT coalesce(%(cur)s::pg_snapshot, pg_current_snapshot()) AS s
), found AS (
    SELECT o.id, o.event_id, o.topic, o.key, o.payload, o.payload_bytes, o.headers,
           o.xid, o.attempts, o.created_at,
           -- The message's size without serialising it, as the producer counts it against
           -- its limit (%(max_bytes)s): payload, key and headers.  An uncompressed jsonb's
           -- stored size is close to its text's; a compressed one, or a payload near the
           -- limit, is measured exactly (rare, large rows only); a text's length is read
           -- from its header, compressed or not.
           CASE WHEN o.payload IS NULL THEN coalesce(octet_length(o.payload_bytes), 0)
                WHEN pg_column_compression(o.payload) IS NULL
                     AND pg_column_size(o.payload) <= %(max_bytes)s / 2
                THEN pg_column_size(o.payload)
                ELSE octet_length(o.payload::text) END AS payload_size,
           coalesce(octet_length(o.key), 0) AS key_bytes,
           CASE WHEN pg_column_compression(o.headers) IS NULL THEN pg_column_size(o.headers)
                ELSE octet_length(o.headers::text) END AS header_bytes
    FROM (
        (SELECT * FROM {table} AS i
         WHERE i.published_at IS NULL
           AND i.xid = ANY(%(prev_xip)s::xid8[])
           AND (i.xid, i.id) > (%(after_xid)s::xid8, %(after_id)s::bigint)
         ORDER BY i.xid, i.id)
        UNION ALL
        (SELECT * FROM {table} AS i
         WHERE i.published_at IS NULL
           AND i.xid >= %(prev_xmax)s::xid8
           AND i.xid < (SELECT pg_snapshot_xmax(s) FROM cur)
           -- The position, or just below prev_xmax when it is below that (a new window):
           -- the index scan starts at this bound, and one at (0, 0) walked every entry
           -- below the window (rows in back-off, dead entries of marked rows) each claim.
           AND (i.xid, i.id) > (%(from_xid)s::xid8, %(from_id)s::bigint)
         ORDER BY i.xid, i.id)
    ) AS o
    WHERE pg_visible_in_snapshot(o.xid, (SELECT s FROM cur))
      AND (%(all_shards)s OR (hashtext(coalesce(o.key, o.event_id::text)) & 2147483647) %% %(nshards)s = ANY(%(shards)s::int[]))
      AND (o.retry_at IS NULL OR o.retry_at <= coalesce(%(now)s::timestamptz, now()))
      AND (o.key IS NULL
           -- In the retrying index's order, so that it is read by that index whatever the
           -- statistics say: an EXISTS planned from statistics of a back-off episode (many
           -- rows in back-off) was a scan of the whole table, and read every row at every
           -- claim once the episode was over, until the next ANALYZE.
           OR (SELECT 1 FROM {table} AS w
               WHERE w.published_at IS NULL AND w.retry_at IS NOT NULL
               ORDER BY w.key, w.xid, w.id
               LIMIT 1) IS NULL
           OR NOT EXISTS (
          SELECT 1 FROM {table} AS b
          WHERE b.published_at IS NULL AND b.retry_at IS NOT NULL
            AND b.key = o.key
            AND (b.xid, b.id) < (o.xid, o.id)
            AND (b.retry_at > coalesce(%(now)s::timestamptz, now())
                 OR NOT (b.id = ANY(%(sent_retries)s::bigint[])
                         OR ((b.xid >= %(prev_xmax)s::xid8 OR b.xid = ANY(%(prev_xip)s::xid8[]))
                             AND (b.xid, b.id) > (%(after_xid)s::xid8, %(after_id)s::bigint))))))
    ORDER BY o.xid, o.id
    LIMIT %(limit)s
), budget AS (
    -- The batch's byte budget (%(budget_bytes)s): rows until the one that crosses it; a
    -- row over the producer's limit comes without its payload, so a 20 MB row costs the
    -- relay its size, not its bytes.  A ROWS frame: ids are unique, so no row has peers
    -- and the sums are the default RANGE frame's, without comparing each row to the next.
    SELECT f.*, s.size,
           sum(least(s.size, %(max_bytes)s))
               OVER (ORDER BY f.xid, f.id ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
               AS running
    FROM found AS f
    CROSS JOIN LATERAL (SELECT f.payload_size + f.key_bytes + f.header_bytes AS size) AS s
)
-- The columns are the relay's OutboxRow, in its order, plus the running byte count: the
-- value as the bytes Kafka gets (a jsonb payload's compact text in UTF-8), the xid as a
-- number, so that the relay builds each row straight from the tuple.  date_part, not
-- extract: extract's numeric result cast to float8 cost 8 % of the claim's execution.
-- A row over the producer's limit comes without its payload, and without its key or its
-- headers when they are a quarter of that limit or more: it is dead-lettered by its size,
-- and what the relay holds of it (and the dead-letter topic's record) stays small.
SELECT b.id, b.event_id::text AS event_id, b.topic,
       CASE WHEN b.size <= %(max_bytes)s OR b.key_bytes < %(max_bytes)s / 4 THEN b.key END AS key,
       CASE WHEN b.size <= %(max_bytes)s
            THEN coalesce(b.payload_bytes, convert_to(b.payload::text, 'UTF8')) END AS value,
       CASE WHEN b.size <= %(max_bytes)s OR b.header_bytes < %(max_bytes)s / 4
            THEN b.headers::text END AS headers_json, b.xid::text::bigint AS xid,
       (hashtext(coalesce(b.key, b.event_id::text)) & 2147483647) %% %(nshards)s AS shard,
       b.attempts, date_part('epoch', b.created_at) AS created_epoch,
       b.size::bigint AS size, b.running::bigint AS running
FROM budget AS b
WHERE b.running - least(b.size, %(max_bytes)s) < %(budget_bytes)s
UNION ALL
-- The window's snapshot, when this claim took it: one more row, whose id is NULL and
-- whose headers_json column carries the snapshot.
SELECT NULL, NULL, NULL, NULL, NULL, (SELECT s::text FROM cur), NULL, NULL, NULL, NULL,
       NULL, NULL
WHERE %(cur)s::text IS NULL

-- name: sweep
-- A rewind's look at the table before its claim from "nothing seen", in one round trip
-- (two statements until issue 18's thirty-third pass: with the heartbeat's two, a fifth of
-- an idle relay's statements): the rows with a foreign xid restamped, and when the next
-- row in back-off of the shards held is due.
--
-- restamped:
-- Rows whose xid is not one of this cluster's (copied by pg_dump/restore or logical
-- replication from another cluster) and that no window would hold in order: a
-- visible row whose xid is at or above this statement's snapshot xmax, or names a
-- transaction this cluster did not commit, was not written by that transaction.
-- They take this transaction's xid, so the next windows claim them like rows it
-- committed, in id order within their keys.  (Foreign xids that happen to name a
-- committed transaction look like old rows: the periodic sweeps relay them in
-- their original (xid, id) order.)
--
-- due_in_s:
-- In how many seconds the earliest row in back-off of the shards held is due (NULL: none
-- ahead).  A rewind asks, so that a retry another replica scheduled (or this relay before a
-- restart) is sent at its time: only a full pass sends a due row, and its key waits for it.
-- Reads at most the first %(limit)s entries of the small retrying index, in its own order
-- (so that only that index answers, whatever the statistics say); rows beyond them are
-- sent at the periodic pass.
WITH restamped AS (
    UPDATE {table} AS o
    SET xid = pg_current_xact_id()
    WHERE o.published_at IS NULL
      AND CASE WHEN o.xid >= pg_snapshot_xmax(pg_current_snapshot()) THEN true
               ELSE pg_xact_status(o.xid) IS DISTINCT FROM 'committed' END
    RETURNING 1
)
SELECT (SELECT count(*) FROM restamped) AS restamped,
       (SELECT extract(epoch FROM min(w.retry_at) - coalesce(%(now)s::timestamptz, now()))::float8
        FROM (SELECT r.retry_at, r.key, r.event_id
              FROM {table} AS r
              WHERE r.published_at IS NULL AND r.retry_at IS NOT NULL
              ORDER BY r.key, r.xid, r.id
              LIMIT %(limit)s) AS w
        WHERE w.retry_at > coalesce(%(now)s::timestamptz, now())
          AND (%(all_shards)s OR (hashtext(coalesce(w.key, w.event_id::text)) & 2147483647) %% %(nshards)s
                                 = ANY(%(shards)s::int[]))) AS due_in_s

-- name: fence_held_shards
-- The fence every mark of a batch takes (included by mark_published and its variants):
-- the shards of the batch whose lease this owner still holds with the same token.  FOR
-- SHARE on the lease rows makes a concurrent takeover wait for the mark's transaction (or
-- makes the mark see the new token and mark nothing).  Written once, so that no copy can
-- drift from the others.
SELECT s.shard
FROM outbox_relay_shards AS s
JOIN unnest(%(held_shards)s::int[], %(held_tokens)s::bigint[]) AS h(shard, token)
  ON h.shard = s.shard AND h.token = s.token
WHERE s.owner = %(owner)s
FOR SHARE OF s

-- name: fence_held_shard
-- The same fence for one row's statements (record_failure, dead_letter): its shard, if
-- this owner still holds its lease with the same token.
SELECT s.shard
FROM outbox_relay_shards AS s
WHERE s.shard = %(shard)s AND s.token = %(token)s AND s.owner = %(owner)s
FOR SHARE OF s

-- name: fenced_marks_result
-- What a fenced mark returns: the shards still held, and the ids it marked (or deleted).
SELECT (SELECT coalesce(array_agg(shard), ARRAY[]::int[]) FROM held) AS held,
       (SELECT coalesce(array_agg(id), ARRAY[]::bigint[]) FROM marked) AS marked

-- name: mark_published
-- Fenced: rows are marked only in shards whose lease this owner still holds with
-- the same token.  FOR SHARE on the lease rows makes a concurrent takeover wait
-- for this transaction (or makes this one see the new token and mark nothing).
-- The ids of the held shards' rows go to the primary key as one array (= ANY): one scan
-- that walks the index's leaves in id order, where a join with unnest looked each id up
-- from the root, 11 % more execution for a batch of 1,000 (issue 18's thirtieth pass).
WITH held AS (
    -- include: fence_held_shards
), marked AS (
    UPDATE {table} AS o
    SET published_at = coalesce(%(now)s::timestamptz, now()), retry_at = NULL
    WHERE o.id = ANY(ARRAY(SELECT r.id
                           FROM unnest(%(ids)s::bigint[], %(row_shards)s::int[]) AS r(id, shard)
                           WHERE r.shard IN (SELECT shard FROM held)))
      AND o.published_at IS NULL
    RETURNING o.id
)
-- include: fenced_marks_result

-- name: mark_published_by_event
-- mark_published on a partitioned outbox, whose primary key (id, created_at) lets two
-- partitions hold one id (a back-fill with OVERRIDING SYSTEM VALUE, a switchover from
-- logical replication that left the sequence behind): by id alone, publishing one of
-- them marked the other too, which was never sent (an audit lost 1,240 rows so).  Each
-- row is matched by its id and its event_id.
WITH held AS (
    -- include: fence_held_shards
), marked AS (
    UPDATE {table} AS o
    SET published_at = coalesce(%(now)s::timestamptz, now()), retry_at = NULL
    FROM unnest(%(ids)s::bigint[], %(row_shards)s::int[], %(event_ids)s::uuid[]) AS r(id, shard, event_id)
    WHERE o.id = r.id AND o.event_id = r.event_id AND r.shard IN (SELECT shard FROM held)
      AND o.published_at IS NULL
    RETURNING o.id
)
-- include: fenced_marks_result

-- name: delete_published_by_event
-- delete_published on a partitioned outbox: see mark_published_by_event.
WITH held AS (
    -- include: fence_held_shards
), marked AS (
    DELETE FROM {table} AS o
    USING unnest(%(ids)s::bigint[], %(row_shards)s::int[], %(event_ids)s::uuid[]) AS r(id, shard, event_id)
    WHERE o.id = r.id AND o.event_id = r.event_id AND r.shard IN (SELECT shard FROM held)
      AND o.published_at IS NULL
    RETURNING o.id
)
-- include: fenced_marks_result

-- name: event_ids
-- Exactly-once recovery: the event_id of each row a position record lists, to mark only
-- the rows that still hold the listed events.  A database restored from a backup hands
-- out again the ids published since: a record read after it names new rows by their ids.
SELECT o.id, o.event_id
FROM {table} AS o
WHERE o.id = ANY(%(ids)s::bigint[])

-- name: delete_published
-- mark_published for a relay run with --keep-published false: the acknowledged rows
-- are deleted instead of marked, fenced the same way.  A delete only stamps the old
-- row version, where a mark writes a new version of the whole row and an entry in
-- each of its indexes: about a tenth of the database's work per row.
WITH held AS (
    -- include: fence_held_shards
), marked AS (
    DELETE FROM {table} AS o
    WHERE o.id = ANY(ARRAY(SELECT r.id
                           FROM unnest(%(ids)s::bigint[], %(row_shards)s::int[]) AS r(id, shard)
                           WHERE r.shard IN (SELECT shard FROM held)))
      AND o.published_at IS NULL
    RETURNING o.id
)
-- include: fenced_marks_result

-- name: record_failure
-- Fenced like mark_published: counts an attempt, keeps the broker's message and
-- schedules the retry.  %(event_id)s: the row's event_id on a partitioned outbox, where
-- two rows may share an id (see mark_published_by_event): by id alone, a row's failure
-- put its twin in back-off too and counted its attempts toward the dead letters.  NULL
-- on the plain outbox, whose primary key keeps ids unique.
WITH held AS (
    -- include: fence_held_shard
)
UPDATE {table} AS o
SET attempts = o.attempts + 1,
    last_error = %(error)s,
    retry_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(backoff_s)s)
WHERE o.id = %(id)s AND o.event_id = coalesce(%(event_id)s::uuid, o.event_id)
  AND o.published_at IS NULL AND EXISTS (SELECT 1 FROM held)
RETURNING o.attempts

-- name: dead_letter
-- Fenced move of one row to the dead letters, in one statement: never in both
-- places, never in neither.  %(event_id)s as in record_failure: by id alone, a row
-- refused for good took its pending twin into the dead letters with it.
WITH held AS (
    -- include: fence_held_shard
), moved AS (
    DELETE FROM {table} AS o
    WHERE o.id = %(id)s AND o.event_id = coalesce(%(event_id)s::uuid, o.event_id)
      AND o.published_at IS NULL AND EXISTS (SELECT 1 FROM held)
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
-- The outbox is looked up as the queries name it, each part quoted (--table Outbox is
-- "Outbox", not outbox), and must have the columns the relay reads and writes: --table
-- naming another table was a traceback at the first claim, or a cleanup of its rows.
WITH target AS (
    SELECT to_regclass(string_agg(quote_ident(p.part), '.' ORDER BY p.n)) AS oid
    FROM unnest(string_to_array(%(table)s, '.')) WITH ORDINALITY AS p(part, n)
)
SELECT t.oid IS NOT NULL AS has_outbox,
       ARRAY(SELECT c.name
             FROM unnest(ARRAY['id', 'event_id', 'topic', 'key', 'payload', 'payload_bytes',
                               'headers', 'created_at', 'published_at', 'xid', 'attempts',
                               'last_error', 'retry_at']) WITH ORDINALITY AS c(name, n)
             WHERE t.oid IS NOT NULL
               AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute AS a
                               WHERE a.attrelid = t.oid AND a.attname = c.name
                                 AND a.attnum > 0 AND NOT a.attisdropped)
             ORDER BY c.n) AS missing_columns,
       to_regclass('outbox_relay_shards') IS NOT NULL AS has_shards,
       to_regclass('outbox_relay_settings') IS NOT NULL AS has_settings
FROM target AS t

-- name: read_settings
SELECT shards FROM outbox_relay_settings

-- name: read_outbox_id
-- Migration 0013's identity of this database's outbox (exactly-once mode's position records).
SELECT outbox_id::text AS outbox_id FROM outbox_relay_settings

-- name: async_commit
-- The relay's own writes (marks, lease renewals, dead-letter moves) commit without
-- waiting for the WAL flush: losing one to a database crash means a redelivery or
-- a fenced write, never a lost row.  And its sessions, idle between polls by design,
-- are not ended by an idle_session_timeout set for the role or the database: ended,
-- they flapped (database_unavailable, database_recovered) and a mark lost with one sent
-- its rows again (an audit: 8 duplicates of 9 rows at one row every 5 s, 3 s timeout).
SELECT set_config('synchronous_commit', 'off', false),
       CASE WHEN current_setting('server_version_num')::int >= 140000
            THEN set_config('idle_session_timeout', '0', false) END

-- name: keep_session
-- The LISTEN session idles most of all: see async_commit.
SELECT CASE WHEN current_setting('server_version_num')::int >= 140000
            THEN set_config('idle_session_timeout', '0', false) END

-- name: listen
LISTEN outbox_relay

-- name: listen_shards
-- Shards changing hands between replicas (leases.sql's notify_shards).
LISTEN outbox_relay_shards

-- name: go_to_sleep
-- On the LISTEN connection: false when writers are mid-transaction or another
-- relay already sleeps (see sql/migrations/0003_notify.sql); peer_sleeps tells which:
-- another session holds the lock exclusively (a relay; then writers notify every
-- listener, this one too).  Key 7263740001 is classid 1, objid 2968772705 in pg_locks.
-- Read only when the lock was refused (an InitPlan runs when first needed).
WITH attempt AS MATERIALIZED (
    SELECT pg_try_advisory_lock(7263740001) AS sleeping
)
SELECT a.sleeping,
       CASE WHEN a.sleeping THEN false
            ELSE EXISTS (SELECT 1 FROM pg_locks AS k
                         WHERE k.locktype = 'advisory' AND k.classid = 1
                           AND k.objid = 2968772705 AND k.objsubid = 1
                           AND k.mode = 'ExclusiveLock' AND k.granted
                           AND k.database = (SELECT d.oid FROM pg_database AS d
                                             WHERE d.datname = current_database()))
       END AS peer_sleeps
FROM attempt AS a

-- name: wake_up
SELECT pg_advisory_unlock(7263740001) AS released

-- name: backend_pid
-- The server process of this connection: two client connections on one server
-- process, or one that changes server process between transactions, means a
-- transaction pooler (relay/store.py check_not_transaction_pooled).
SELECT pg_backend_pid() AS pid
