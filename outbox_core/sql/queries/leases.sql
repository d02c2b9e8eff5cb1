-- Named queries for shard leases and replica membership.

-- name: heartbeat_replica
-- Announce this replica and count the live ones (itself included) in one round trip.
WITH me AS (
    INSERT INTO outbox_relay_replicas (owner, seen_until, stalled)
    VALUES (%(owner)s, coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(ttl_s)s),
            %(stalled)s::jsonb)
    ON CONFLICT (owner) DO UPDATE SET seen_until = excluded.seen_until, stalled = excluded.stalled
    RETURNING owner
)
SELECT 1 + count(*) AS live
FROM outbox_relay_replicas AS r
WHERE r.seen_until > coalesce(%(now)s::timestamptz, now())
  AND r.owner <> (SELECT owner FROM me)

-- name: forget_replica
DELETE FROM outbox_relay_replicas WHERE owner = %(owner)s

-- name: prune_replicas
DELETE FROM outbox_relay_replicas
WHERE seen_until < coalesce(%(now)s::timestamptz, now()) - interval '1 hour'

-- name: renew_leases
-- Only leases this owner still holds with the same token; a missing shard in the
-- result means another replica claimed it (a new token) and this one must stop.
UPDATE outbox_relay_shards AS s
SET lease_until = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_s)s)
FROM unnest(%(shards)s::int[], %(tokens)s::bigint[]) AS h(shard, token)
WHERE s.shard = h.shard AND s.token = h.token AND s.owner = %(owner)s
RETURNING s.shard, s.token, extract(epoch FROM s.lease_until)::float8 AS lease_until_epoch

-- name: claim_shards
-- Unowned or expired shards, at most %(limit)s, each with a new token.
WITH free AS (
    SELECT shard FROM outbox_relay_shards
    WHERE owner IS NULL OR lease_until <= coalesce(%(now)s::timestamptz, now())
    ORDER BY shard
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_relay_shards AS s
SET owner = %(owner)s,
    token = s.token + 1,
    lease_until = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_s)s)
FROM free
WHERE s.shard = free.shard
RETURNING s.shard, s.token, extract(epoch FROM s.lease_until)::float8 AS lease_until_epoch

-- name: release_shards
UPDATE outbox_relay_shards AS s
SET owner = NULL, lease_until = NULL
FROM unnest(%(shards)s::int[], %(tokens)s::bigint[]) AS h(shard, token)
WHERE s.shard = h.shard AND s.token = h.token AND s.owner = %(owner)s
RETURNING s.shard

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

