-- Named queries of replays (relay/replay.py, relay/replay_admin.py; schema in
-- sql/migrations/0007_replays.sql).  {table} is the outbox, composed with
-- psycopg.sql.Identifier.  A replay selects rows created in [since, until) and
-- published at or before requested_at, optionally of some topics (%(topics)s, empty:
-- all) and keys (%(keys)s, empty: all); a shard's rows go out in the order they were
-- first published: (published_at, xid, id).

-- name: dry_run
-- Rows per topic a replay with these parameters would select, and their time range.
SELECT o.topic, count(*) AS rows, min(o.created_at) AS first_created_at,
       max(o.created_at) AS last_created_at
FROM {table} AS o
WHERE o.published_at IS NOT NULL
  AND o.created_at >= %(since)s::timestamptz
  AND o.created_at < coalesce(%(until)s::timestamptz, now())
  AND (cardinality(%(topics)s::text[]) = 0 OR o.topic = ANY(%(topics)s::text[]))
  AND (cardinality(%(keys)s::text[]) = 0 OR o.key = ANY(%(keys)s::text[]))
GROUP BY o.topic
ORDER BY o.topic

-- name: retained_range
-- What retention left: the oldest and newest published row still in the outbox.
SELECT min(created_at) AS oldest, max(created_at) AS newest, count(*) AS rows
FROM {table}
WHERE published_at IS NOT NULL

-- name: create_replay
-- Records a request and how many rows it selects now (the selection is fixed: rows
-- published at or before requested_at).
INSERT INTO outbox_relay_replays (since, until, topics, keys, rate_per_s, requested_by, selected_rows)
SELECT %(since)s::timestamptz, coalesce(%(until)s::timestamptz, now()), %(topics)s::text[],
       %(keys)s::text[], %(rate)s, coalesce(%(requested_by)s, current_user),
       (SELECT count(*) FROM {table} AS o
        WHERE o.published_at IS NOT NULL AND o.published_at <= now()
          AND o.created_at >= %(since)s::timestamptz
          AND o.created_at < coalesce(%(until)s::timestamptz, now())
          AND (cardinality(%(topics)s::text[]) = 0 OR o.topic = ANY(%(topics)s::text[]))
          AND (cardinality(%(keys)s::text[]) = 0 OR o.key = ANY(%(keys)s::text[])))
RETURNING id, selected_rows, since, until, requested_at

-- name: list_replays
-- Newest first, with their progress summed over shards.  since and until are shown within
-- 1970 .. 9000 (replay --since refuses times outside it): a time stored before that check
-- (a year before 1, after 9999 in the session's time zone) could not be read back, and
-- every relay died reading its active replays.  replay_batch reads the stored range.
SELECT r.id, r.state,
       greatest(r.since, '1970-01-01 00:00:00+00'::timestamptz) AS since,
       least(r.until, '9000-01-01 00:00:00+00'::timestamptz) AS until,
       r.topics, r.keys, r.rate_per_s, r.requested_at,
       r.requested_by, r.selected_rows, r.finished_at,
       coalesce(sum(p.sent), 0)::bigint AS sent,
       count(p.shard) FILTER (WHERE p.done) AS shards_done,
       CASE WHEN r.state = 'done' THEN 0
            ELSE greatest(r.selected_rows - coalesce(sum(p.sent), 0), 0) END::bigint AS rows_left
FROM outbox_relay_replays AS r
LEFT JOIN outbox_relay_replay_progress AS p ON p.replay_id = r.id
WHERE (%(active_only)s IS NOT TRUE OR r.state = 'active')
GROUP BY r.id
ORDER BY r.id DESC
LIMIT %(limit)s

-- name: cancel_replay
UPDATE outbox_relay_replays
SET state = 'cancelled', finished_at = now()
WHERE id = %(replay_id)s AND state = 'active'
RETURNING id

-- name: load_progress
-- Where each of these shards stands in a replay (no row: from the start).
SELECT shard, published_at, xid::text AS xid, row_id, done
FROM outbox_relay_replay_progress
WHERE replay_id = %(replay_id)s AND shard = ANY(%(shards)s::int[])

-- name: replay_batch
-- The next rows of one shard after the replay's position in it, in first-publication
-- order.  Nothing while the replay is not active.  At most %(limit)s rows, and rows only
-- until the one whose message (payload, key and headers, as text) crosses
-- %(budget_bytes)s: the replay's bytes in flight stay bounded however large the rows (the
-- first row always comes).
WITH found AS (
    SELECT o.id, o.event_id::text AS event_id, o.topic, o.key, o.payload::text AS payload_text,
           o.payload_bytes, o.headers::text AS headers_text, o.xid::text AS xid, o.published_at,
           extract(epoch FROM o.created_at)::float8 AS created_epoch, o.xid AS xid8
    FROM outbox_relay_replays AS r
    JOIN {table} AS o
      ON o.published_at IS NOT NULL
     AND o.published_at <= r.requested_at
     AND o.created_at >= r.since AND o.created_at < r.until
     AND (cardinality(r.topics) = 0 OR o.topic = ANY(r.topics))
     AND (cardinality(r.keys) = 0 OR o.key = ANY(r.keys))
    WHERE r.id = %(replay_id)s AND r.state = 'active'
      -- The plain bound lets outbox_published_idx (published_at) start the scan at the
      -- position; (xid, id) order within one published_at is an incremental sort.
      AND o.published_at >= coalesce(%(after_published_at)s::timestamptz, '-infinity'::timestamptz)
      AND (hashtext(coalesce(o.key, o.event_id::text)) & 2147483647) %% %(nshards)s = %(shard)s
      AND (o.published_at, o.xid, o.id)
          > (coalesce(%(after_published_at)s::timestamptz, '-infinity'::timestamptz),
             coalesce(%(after_xid)s::xid8, '0'::xid8), coalesce(%(after_id)s::bigint, 0))
    ORDER BY o.published_at, o.xid, o.id
    LIMIT %(limit)s
), sized AS (
    SELECT f.*, coalesce(octet_length(f.payload_text), 0) + coalesce(octet_length(f.payload_bytes), 0)
                + coalesce(octet_length(f.key), 0) + octet_length(f.headers_text) AS size
    FROM found AS f
), budget AS (
    SELECT z.*, sum(z.size) OVER (ORDER BY z.published_at, z.xid8, z.id
                                  ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS running
    FROM sized AS z
)
SELECT b.id, b.event_id, b.topic, b.key, b.payload_text, b.payload_bytes, b.headers_text,
       b.xid, b.published_at, b.created_epoch, b.size::bigint AS size
FROM budget AS b
WHERE b.running - b.size < %(budget_bytes)s
ORDER BY b.published_at, b.xid8, b.id

-- name: advance_progress
-- Fenced: only the holder of the shard's lease (owner and token) moves the replay's
-- position in it, only while the replay is active, and only from the position it
-- read (%(from_id)s; NULL: no position yet).  held/active/written say which guard
-- failed: held 0 means the lease is lost.
WITH held AS (
    SELECT s.shard
    FROM outbox_relay_shards AS s
    WHERE s.shard = %(shard)s AND s.token = %(token)s AND s.owner = %(owner)s
    FOR SHARE OF s
), active AS (
    SELECT r.id FROM outbox_relay_replays AS r
    WHERE r.id = %(replay_id)s AND r.state = 'active'
), written AS (
    INSERT INTO outbox_relay_replay_progress AS p
        (replay_id, shard, published_at, xid, row_id, sent, done, owner, token, updated_at)
    SELECT %(replay_id)s, %(shard)s, %(published_at)s::timestamptz, %(xid)s::xid8, %(row_id)s,
           %(sent)s, %(done)s, %(owner)s, %(token)s, now()
    FROM held, active
    ON CONFLICT (replay_id, shard) DO UPDATE
    SET published_at = coalesce(excluded.published_at, p.published_at),
        xid = coalesce(excluded.xid, p.xid),
        row_id = coalesce(excluded.row_id, p.row_id),
        sent = p.sent + excluded.sent,
        done = excluded.done,
        owner = excluded.owner,
        token = excluded.token,
        updated_at = excluded.updated_at
    WHERE p.token <= excluded.token AND p.row_id IS NOT DISTINCT FROM %(from_id)s::bigint
    RETURNING p.shard
)
SELECT (SELECT count(*) FROM held) AS held, (SELECT count(*) FROM active) AS active,
       (SELECT count(*) FROM written) AS written

-- name: finish_replay
-- A replay whose every shard is done is done.
UPDATE outbox_relay_replays AS r
SET state = 'done', finished_at = now()
WHERE r.id = %(replay_id)s AND r.state = 'active'
  AND (SELECT count(*) FROM outbox_relay_replay_progress AS p
       WHERE p.replay_id = r.id AND p.done) >= %(nshards)s
RETURNING r.id
