-- Named queries of the partitioned outbox (see sql/migrations/0001_outbox.partitioned.sql).
-- Blocks with {placeholders} are composed with psycopg.sql.Identifier/Literal.

-- name: is_partitioned
SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass('outbox'))
    AS partitioned

-- name: list_partitions
SELECT c.relname AS name
FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass('outbox')
ORDER BY c.relname

-- name: short_lock_timeout
-- Partition DDL waits at most this long for its lock (writers queue behind it
-- meanwhile); a miss is retried at the next run.  Transaction-local: no session
-- state is left behind (a pooled connection stays clean).
SET LOCAL lock_timeout = '200ms'

-- name: create_partition
CREATE TABLE IF NOT EXISTS {partition} PARTITION OF outbox FOR VALUES FROM ({lo}) TO ({hi})

-- name: mark_room_indexes
-- A new partition's primary key and event_id index (its parts of the outbox's two unique
-- indexes), which get the fillfactor migration 0015 gives the plain outbox's.
SELECT n.nspname AS schema, c.relname AS name
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
JOIN pg_index AS x ON x.indexrelid = c.oid
WHERE i.inhparent IN (to_regclass('outbox_pkey'), to_regclass('outbox_event_id_unique'))
  AND x.indrelid = to_regclass(%(partition)s)

-- name: mark_room
ALTER INDEX {index} SET (fillfactor = 50)

-- name: lock_for_drop
-- Before the pending check, in the same transaction: the locks DETACH takes, in the
-- order writers take them (the parent, then the partition).  No writer can then
-- commit a row into the partition between the check and the DETACH; one that is
-- mid-transaction makes this wait (lock_timeout) and its row is seen by the check.
LOCK TABLE ONLY outbox, {partition} IN ACCESS EXCLUSIVE MODE

-- name: partition_has_pending
SELECT EXISTS (SELECT 1 FROM {partition} WHERE published_at IS NULL) AS pending

-- name: detach_partition
ALTER TABLE outbox DETACH PARTITION {partition}

-- name: drop_partition
DROP TABLE IF EXISTS {partition}

-- name: default_partition_rows
SELECT count(*) AS rows FROM outbox_default

-- name: outbox_layout
-- What `migrate` finds: no outbox yet, a plain one, or a partitioned one.
SELECT CASE WHEN to_regclass('outbox') IS NULL THEN 'none'
            WHEN EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass('outbox'))
                THEN 'partitioned'
            ELSE 'plain' END AS layout

-- name: detached_partitions
-- Tables of the outbox's schema named as its daily partitions that are no partition
-- (a DBA's ALTER TABLE outbox DETACH PARTITION): their rows are no longer in the outbox.
SELECT c.relname AS name
FROM pg_class AS c
WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass('outbox'))
  AND c.relname ~ '^outbox_p[0-9]{8}$'
  AND c.relkind IN ('r', 'p')
  AND NOT c.relispartition
ORDER BY c.relname

-- name: detached_pending
-- A detached partition's unpublished rows, up to %(cap)s (its copy of the pending index).
SELECT count(*) AS pending
FROM (SELECT 1 FROM {partition} WHERE published_at IS NULL LIMIT %(cap)s) AS p
