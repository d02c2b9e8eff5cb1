-- Named queries of `outbox-relay bench` and its baselines (outbox_embedded/baselines.py).

-- name: bench_load_pending
-- %(count)s pending rows of about %(payload_bytes)s bytes over %(keys)s keys.
INSERT INTO outbox (topic, key, payload)
SELECT %(topic)s, 'k' || (g %% %(keys)s),
       jsonb_build_object('n', g, 'pad', repeat('x', greatest(0, %(payload_bytes)s - 24)))
FROM generate_series(1, %(count)s) AS g

-- name: bench_load_published
-- Rows already published, as a long-lived outbox without retention has them.
INSERT INTO outbox (topic, key, payload, published_at)
SELECT %(topic)s, 'k' || (g %% %(keys)s),
       jsonb_build_object('n', g, 'pad', repeat('x', greatest(0, %(payload_bytes)s - 24))), now()
FROM generate_series(1, %(count)s) AS g

-- name: bench_latency
-- Commit-to-mark latency of the rows written by the latency run (published_at is
-- set right after the broker's acknowledgement).
SELECT event_id::text AS event_id, extract(epoch FROM published_at)::float8 AS published_epoch
FROM outbox
WHERE published_at IS NOT NULL AND event_id = ANY(%(event_ids)s::uuid[])

-- name: bench_now
SELECT clock_timestamp() AS now

-- name: bench_drain_span
-- A drain's rate from the marks' own timestamps: rows marked after the first mark
-- of the run, over the time from that mark to the last one.
WITH span AS (
    SELECT min(published_at) AS t0, max(published_at) AS t1
    FROM outbox WHERE published_at >= %(since)s::timestamptz
)
SELECT (SELECT count(*) FROM outbox WHERE published_at > span.t0) AS rows_after_first,
       extract(epoch FROM span.t1 - span.t0)::float8 AS span_s
FROM span

-- name: bench_notify_trigger_off
ALTER TABLE outbox DISABLE TRIGGER outbox_notify_insert

-- name: bench_notify_trigger_on
ALTER TABLE outbox ENABLE TRIGGER outbox_notify_insert

-- name: bench_pgbench_insert
-- One small writer transaction, as pgbench runs it (its own variable syntax).
INSERT INTO outbox (topic, key, payload) VALUES ('bench.notify', 'k' || (random() * 1000)::int, '{"n": 1}')

-- name: bench_table_size
SELECT pg_table_size('outbox')::float8 / 1048576 AS table_mb,
       pg_indexes_size('outbox')::float8 / 1048576 AS index_mb

-- name: bench_stalled_writer
-- A session that writes one outbox row and then sits idle in transaction.
INSERT INTO outbox (topic, key, payload) VALUES (%(topic)s, 'stalled', '{}')

-- name: bench_min_table
-- The physical floor's table (issue 18): the least an outbox can be, one partial index.
CREATE TABLE bench_min (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key          text,
    payload      bytea NOT NULL,
    published_at timestamptz
);
CREATE INDEX bench_min_pending ON bench_min (id) WHERE published_at IS NULL

-- name: bench_min_load
INSERT INTO bench_min (key, payload)
SELECT 'k' || (g %% %(keys)s), convert_to(repeat('x', %(payload_bytes)s), 'UTF8')
FROM generate_series(1, %(count)s) AS g

-- name: bench_min_claim
-- What a plain relay claims: locked rows, skipped when locked.
SELECT id, key, payload FROM bench_min
WHERE published_at IS NULL
ORDER BY id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: bench_min_mark
UPDATE bench_min SET published_at = now() WHERE id = ANY(%(ids)s::bigint[])

-- name: bench_shard_spread
-- How the shards' live leases are spread: owners, the fewest and the most shards one
-- holds, and the shard count (the scale-out figure waits for every replica's share).
WITH held AS (
    SELECT owner, count(*) AS n
    FROM outbox_relay_shards
    WHERE owner IS NOT NULL AND lease_until > now()
    GROUP BY owner
)
SELECT count(*) AS owners, coalesce(min(n), 0) AS fewest, coalesce(max(n), 0) AS most,
       (SELECT count(*) FROM outbox_relay_shards) AS shards
FROM held
