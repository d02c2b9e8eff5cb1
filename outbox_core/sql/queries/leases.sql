-- Named queries for shard leases and replica membership.

-- name: heartbeat
-- One heartbeat in one round trip: announce this replica, renew the leases it holds by
-- token, and count the live replicas (itself included).  A shard missing from the
-- renewed arrays was claimed by another replica (a new token): this one must stop.
-- (Two statements until issue 18's thirty-third pass: an idle relay's heartbeat was a
-- quarter of its statements.)  The arrays are ordered by shard, so each token is its
-- shard's.
WITH me AS (
    INSERT INTO outbox_relay_replicas (owner, seen_until, stalled)
    VALUES (%(owner)s, coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(ttl_s)s),
            %(stalled)s::jsonb)
    ON CONFLICT (owner) DO UPDATE SET seen_until = excluded.seen_until, stalled = excluded.stalled
    RETURNING owner
), renewed AS (
    UPDATE outbox_relay_shards AS s
    SET lease_until = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_s)s)
    FROM unnest(%(shards)s::int[], %(tokens)s::bigint[]) AS h(shard, token)
    WHERE s.shard = h.shard AND s.token = h.token AND s.owner = %(owner)s
    RETURNING s.shard, s.token
)
SELECT (SELECT 1 + count(*)
        FROM outbox_relay_replicas AS r
        WHERE r.seen_until > coalesce(%(now)s::timestamptz, now())
          AND r.owner <> (SELECT owner FROM me)) AS live,
       (SELECT coalesce(array_agg(shard ORDER BY shard), '{}') FROM renewed) AS shards,
       (SELECT coalesce(array_agg(token ORDER BY shard), '{}') FROM renewed) AS tokens

-- name: forget_replica
DELETE FROM outbox_relay_replicas WHERE owner = %(owner)s

-- name: prune_replicas
DELETE FROM outbox_relay_replicas
WHERE seen_until < coalesce(%(now)s::timestamptz, now()) - interval '1 hour'

-- name: claim_shards
-- Unowned or expired shards, at most %(limit)s, each with a new token.  With
-- %(reclaim)s, also the shards still leased to this owner's name that this process
-- does not hold (%(held)s): a previous process of the same name, when this one holds
-- the name's session advisory lock (classid 726374, objid hashtext(owner); taken here
-- on the relay's main connection and kept until it closes).  A container restarted in
-- its pod keeps its name (host name and pid 1), and its old process's connections, so
-- its lock, went with it: the new process resumes at once instead of waiting out the
-- lease.  While another live session holds the lock (a paused process, two relays
-- given one --owner), nothing is reclaimed.  The claim's new token fences whatever the
-- old process left behind either way.
WITH me AS MATERIALIZED (
    SELECT %(reclaim)s::boolean AND (
        EXISTS (SELECT 1 FROM pg_locks AS l
                WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
                  AND l.classid = 726374 AND l.objsubid = 2
                  AND l.objid = (hashtext(%(owner)s)::bigint & 4294967295)::oid)
        OR pg_try_advisory_lock(726374, hashtext(%(owner)s))) AS sole
), free AS (
    SELECT s.shard FROM outbox_relay_shards AS s CROSS JOIN me
    WHERE s.owner IS NULL OR s.lease_until <= coalesce(%(now)s::timestamptz, now())
       OR (me.sole AND s.owner = %(owner)s AND s.shard <> ALL(%(held)s::int[]))
    ORDER BY s.shard
    LIMIT %(limit)s
    FOR UPDATE OF s SKIP LOCKED
)
UPDATE outbox_relay_shards AS s
SET owner = %(owner)s,
    token = s.token + 1,
    lease_until = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_s)s)
FROM free
WHERE s.shard = free.shard
RETURNING s.shard, s.token, extract(epoch FROM s.lease_until)::float8 AS lease_until_epoch

-- name: take_owner_lock
-- The owner name's session advisory lock (claim_shards' classid 726374, objid
-- hashtext(owner)), taken at start on the relay's main connection: false while another
-- live session holds it, that is another live process running under this --owner.
SELECT pg_try_advisory_lock(726374, hashtext(%(owner)s)) AS sole

-- name: release_shards
UPDATE outbox_relay_shards AS s
SET owner = NULL, lease_until = NULL
FROM unnest(%(shards)s::int[], %(tokens)s::bigint[]) AS h(shard, token)
WHERE s.shard = h.shard AND s.token = h.token AND s.owner = %(owner)s
RETURNING s.shard

-- name: notify_shards
-- Tell the other replicas that shards changed hands (given back, or wanted by a
-- replica below its fair share): each runs its heartbeat at once instead of at its
-- next interval.  Delivered on the relays' LISTEN connections (relay/wakeup.py); the
-- payload is the sender, which ignores its own.
SELECT pg_notify('outbox_relay_shards', %(owner)s)

-- name: shard_table
SELECT shard, owner, lease_until, token,
       (lease_until IS NOT NULL AND lease_until > coalesce(%(now)s::timestamptz, now())) AS live
FROM outbox_relay_shards
ORDER BY shard

-- name: set_shards
-- Used by "migrate --shards N" / "reshard": refused while any lease is live.
INSERT INTO outbox_relay_settings (singleton, shards) VALUES (true, %(shards)s)
ON CONFLICT (singleton) DO UPDATE SET shards = excluded.shards, updated_at = now()

-- name: create_shards
INSERT INTO outbox_relay_shards (shard)
SELECT g FROM generate_series(0, %(shards)s - 1) AS g
ON CONFLICT (shard) DO NOTHING

-- name: drop_extra_shards
DELETE FROM outbox_relay_shards WHERE shard >= %(shards)s

-- name: live_leases
SELECT count(*) AS live FROM outbox_relay_shards
WHERE owner IS NOT NULL AND lease_until > coalesce(%(now)s::timestamptz, now())

