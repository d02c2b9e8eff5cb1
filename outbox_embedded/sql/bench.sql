-- Named queries of `outbox-relay bench` and its baselines (outbox_embedded/baselines.py).

-- name: bench_load_pending
-- %(count)s pending rows of about %(payload_bytes)s bytes over %(keys)s keys.
INSERT INTO outbox (topic, key, payload)
SELECT %(topic)s, 'k' || (g %% %(keys)s),
       jsonb_build_object('n', g, 'pad', repeat('x', greatest(0, %(payload_bytes)s - 24)))
FROM generate_series(1, %(count)s) AS g

-- name: bench_load_pending_bytes
-- The same rows with the payload as bytes (payload_bytes: what a writer of Avro or
-- Protobuf stores), the jsonb's own text: mark_bench's bytea_payload variant prices the
-- claim's output of a jsonb payload against it.
INSERT INTO outbox (topic, key, payload_bytes)
SELECT %(topic)s, 'k' || (g %% %(keys)s),
       convert_to(jsonb_build_object('n', g, 'pad', repeat('x', greatest(0, %(payload_bytes)s - 24)))::text,
                  'UTF8')
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

-- The schema variants of outbox_embedded/mark_bench.py (issue 18: what each index and the
-- fillfactor cost a mark).  Each runs on a fresh, empty, migrated database.

-- name: mark_bench_drop_published_index
-- Without the cleanup's index of published rows, one index fewer for each mark to write.
DROP INDEX outbox_published_idx

-- name: mark_bench_drop_pending_index
-- A HOT mark needs no index to name published_at, in a column or a predicate (the claim's
-- index migrate keeps: for the default 16 shards on PostgreSQL 17 and later, 0001's before).
DROP INDEX IF EXISTS outbox_pending_by_16_shards_idx, outbox_pending_idx

-- name: mark_bench_drop_shard_index
DROP INDEX IF EXISTS outbox_pending_by_16_shards_idx

-- name: mark_bench_claim_index_all_rows
CREATE INDEX outbox_claim_all_idx ON outbox (xid, id)

-- name: mark_bench_drop_retrying_index
DROP INDEX outbox_retrying_idx

-- name: mark_bench_retrying_index_without_published_at
CREATE INDEX outbox_retrying_any_idx ON outbox (key, xid, id) WHERE retry_at IS NOT NULL

-- name: mark_bench_published_brin
-- Cleanup by a BRIN index: PostgreSQL 16 and later update summarizing indexes without
-- making an update non-HOT.
CREATE INDEX outbox_published_brin ON outbox USING brin (published_at)

-- name: mark_bench_event_id_unique_pending
-- event_id unique among pending rows only: a mark then writes no entry into that index.
ALTER TABLE outbox DROP CONSTRAINT outbox_event_id_unique

-- name: mark_bench_event_id_unique_pending_index
CREATE UNIQUE INDEX outbox_event_id_pending_unique ON outbox (event_id) WHERE published_at IS NULL

-- name: mark_bench_fillfactor_50
-- Room on each page for a new version of every row: every mark can be HOT.
ALTER TABLE outbox SET (fillfactor = 50)

-- name: mark_bench_fillfactor_70
ALTER TABLE outbox SET (fillfactor = 70)

-- name: mark_bench_pkey_ff_default
-- The primary key as before migration 0015: PostgreSQL's default fillfactor (90), leaves
-- nearly full where ascending inserts split them, so a mark's new entries split them.
ALTER INDEX outbox_pkey RESET (fillfactor)

-- name: mark_bench_event_id_ff_default
-- event_id's unique index as before migration 0015.
ALTER INDEX outbox_event_id_unique RESET (fillfactor)

-- name: mark_bench_bytes_share
-- The share of loaded rows whose payload is bytes (bytea_payload: all; the others: none).
SELECT coalesce(avg((payload_bytes IS NOT NULL)::int), 0)::float8 FROM outbox

-- name: mark_bench_table_stats
SELECT n_tup_upd AS updates, n_tup_hot_upd AS hot_updates, pg_table_size('outbox') AS heap_bytes,
       pg_indexes_size('outbox') AS index_bytes
FROM pg_stat_user_tables WHERE relname = 'outbox'

-- name: mark_bench_index_size
SELECT pg_indexes_size('outbox') AS index_bytes

-- name: claim_bench_plain
-- claim_bench's reference: the relay's claim columns from the pending rows after a position,
-- in (xid, id) order, by a plain scan of the pending index (no window, snapshot, shard,
-- back-off or byte budget).
SELECT o.id, o.event_id::text AS event_id, o.topic, o.key,
       coalesce(o.payload_bytes, convert_to(o.payload::text, 'UTF8')) AS value,
       o.headers::text AS headers_json, o.xid::text::bigint AS xid, o.attempts,
       date_part('epoch', o.created_at) AS created_epoch
FROM outbox AS o
WHERE o.published_at IS NULL
  AND (o.xid, o.id) > (%(from_xid)s::xid8, %(from_id)s::bigint)
ORDER BY o.xid, o.id
LIMIT %(limit)s

-- name: claim_bench_xid_id_index
-- xid_id_index's index: migration 0001's, which migrate's index for the shard count
-- replaced (issue 18's forty-second pass).
CREATE INDEX IF NOT EXISTS outbox_pending_idx ON outbox (xid, id) WHERE published_at IS NULL

-- name: claim_bench_hide_index
-- Inside a transaction rolled back after a variant's statement: the other variant's index.
DROP INDEX {index}

-- name: debezium_table
-- A Debezium outbox table (Debezium's own columns), before adoption, named {table}:
-- claim_bench --adopted's, and the tests' of migrate --debezium-table.
CREATE TABLE {table} (
    id uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb
)

-- name: claim_bench_load_debezium
-- Its backlog: bench_load_pending's rows in Debezium's layout (the key the aggregate id).
INSERT INTO claim_bench.outbox_events (id, aggregatetype, aggregateid, type, payload)
SELECT gen_random_uuid(), 'Order', 'k' || (g %% %(keys)s), 'Changed',
       jsonb_build_object('n', g, 'pad', repeat('x', greatest(0, %(payload_bytes)s - 24)))
FROM generate_series(1, %(count)s) AS g
