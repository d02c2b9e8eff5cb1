-- Relay an existing Debezium-style outbox table without changing its writers.
--
-- Applied by `outbox-relay migrate --debezium-table SOURCE [--view VIEW]
-- [--topic-template T] [--cloudevents-source S]`; the {placeholders} are composed
-- with psycopg.sql.Identifier / Literal, never pasted.  Writers keep inserting
-- (id, aggregatetype, aggregateid, type, payload); the relay's bookkeeping goes into
-- relay_* columns with defaults, and the relay reads and marks through a view that
-- presents the native outbox layout:
--   event_id  <- id                          key  <- aggregateid
--   topic     <- the template (default outbox.event.{aggregatetype}, Debezium's routing)
--   payload   <- payload (jsonb as JSON; text or bytea as bytes)
--   headers   <- id and eventType (Debezium's router headers), plus CloudEvents
--                binary-mode ce_* headers when a source is given
-- Idempotent.  Run the relay with `--table VIEW`.
--
-- Rows already in the table: `--existing published` (the default: Debezium delivered
-- them) or `--existing pending` (relay them).  The only ACCESS EXCLUSIVE lock is held for
-- catalog changes (columns with non-volatile defaults, the view, the trigger), never a
-- table rewrite; numbering the existing rows and building the indexes (CONCURRENTLY)
-- happen afterwards while writers keep writing.

-- name: adopted
-- Whether an earlier run added the relay's columns already.
SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass(%(source)s) AND attname = 'relay_seq'
                 AND NOT attisdropped) AS adopted

-- name: lock_timeout
-- The ACCESS EXCLUSIVE lock below queues every reader and writer of the table behind
-- it while it waits: give up after this long (and retry) rather than stall them.
SET LOCAL lock_timeout = '5s'

-- name: lock_source
LOCK TABLE {source} IN ACCESS EXCLUSIVE MODE

-- name: create_sequence
CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint

-- name: add_columns
-- Catalog-only under the lock: no column has a volatile default, so PostgreSQL stores
-- the defaults once (pg_attribute.attmissingval) instead of rewriting every row.
-- Existing rows read relay_xid 2 (the frozen xid: committed before everything, so they
-- sort before every new row of their key) and relay_published_at now() (the adoption
-- time: Debezium delivered them) or NULL (relay them), per --existing;
-- relay_seq is numbered afterwards in small batches (backfill_seq).
ALTER TABLE {source}
    ADD COLUMN IF NOT EXISTS relay_seq bigint,
    ADD COLUMN IF NOT EXISTS relay_xid xid8 NOT NULL DEFAULT '2'::xid8,
    ADD COLUMN IF NOT EXISTS relay_created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS relay_published_at timestamptz DEFAULT {existing_published_at},
    ADD COLUMN IF NOT EXISTS relay_attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS relay_last_error text,
    ADD COLUMN IF NOT EXISTS relay_retry_at timestamptz

-- name: new_row_defaults
-- From now on, for new rows only (catalog-only as well).
ALTER TABLE {source}
    ALTER COLUMN relay_seq SET DEFAULT nextval({sequence_name}::regclass),
    ALTER COLUMN relay_xid SET DEFAULT pg_current_xact_id(),
    ALTER COLUMN relay_published_at DROP DEFAULT

-- name: sequence_owner
ALTER SEQUENCE {sequence} OWNED BY {seq_column}

-- name: backfill_seq
-- Numbers a batch of existing rows, in physical (ctid) order, after the lock is gone:
-- row locks only, writers keep writing.  The best order there is for rows written
-- without one; returns the last ctid for the next batch (TID range scan).
WITH todo AS MATERIALIZED (
    SELECT ctid AS row_ctid FROM {source}
    WHERE relay_seq IS NULL AND ctid > %(after)s::tid
    ORDER BY ctid
    LIMIT %(limit)s
), numbered AS MATERIALIZED (
    SELECT row_ctid, nextval(%(sequence)s::regclass) AS seq FROM todo ORDER BY row_ctid
), updated AS (
    UPDATE {source} AS t SET relay_seq = numbered.seq
    FROM numbered WHERE t.ctid = numbered.row_ctid AND t.relay_seq IS NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM updated) AS numbered, (SELECT max(row_ctid)::text FROM todo) AS last

-- name: invalid_index
-- A concurrent build an earlier run did not finish (interrupted, cancelled by a timeout):
-- PostgreSQL leaves its index invalid (no query uses it, every write still updates it), and
-- CREATE INDEX CONCURRENTLY IF NOT EXISTS then kept it so at every run after.
SELECT EXISTS (SELECT 1 FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid
               WHERE x.indrelid = to_regclass(%(source)s) AND c.relname = %(index)s
                 AND NOT x.indisvalid) AS invalid

-- name: drop_invalid_index
-- Outside a transaction, as its build: writers go on.
DROP INDEX CONCURRENTLY IF EXISTS {index}

-- name: pending_index
-- The claim's index of the adopted table before PostgreSQL 17 (relay/adopt_index.py), as
-- migration 0001's is the outbox's (admin.sql, pending_index_xid_id).
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {source} (relay_xid, relay_seq)
    WHERE relay_published_at IS NULL

-- name: pending_index_shards
-- The claim's index of the adopted table on PostgreSQL 17 and later, as the outbox's
-- (admin.sql, pending_index_create): the pending rows in (relay_xid, relay_seq) order with
-- each row's shard for the database's shard count as a third key column (the count a
-- literal; run with empty parameters, so that the double percent sign is PostgreSQL's
-- modulo).  The expression is the
-- claim's shard test as it reads through the view (key <- aggregateid::text, event_id <-
-- id::text::uuid), which PostgreSQL matches: a replica holding some of the shards steps
-- over its peers' rows in the index instead of reading them from the table.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {source}
    (relay_xid, relay_seq, ((hashtext(coalesce(aggregateid::text, id::text::uuid::text)) & 2147483647) %% {shards}))
    WHERE relay_published_at IS NULL

-- name: adopted_tables
-- The tables migrate --debezium-table adopted (the relay's relay_seq and relay_xid columns):
-- each one's schema and name, for migrate to keep their claim index for the shard count, and
-- its owner when migrate's role may not build an index on it (NULL: it may).  Not a
-- partition: adopt builds its indexes concurrently, which a partitioned table refuses.
SELECT n.nspname::text AS schema, c.relname::text AS name,
       CASE WHEN NOT pg_has_role(current_user, c.relowner, 'USAGE')
            THEN pg_get_userbyid(c.relowner)::text END AS owner
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.relkind = 'r' AND NOT c.relispartition
  AND EXISTS (SELECT 1 FROM pg_attribute AS a
              WHERE a.attrelid = c.oid AND a.attname = 'relay_seq' AND NOT a.attisdropped)
  AND EXISTS (SELECT 1 FROM pg_attribute AS a
              WHERE a.attrelid = c.oid AND a.attname = 'relay_xid' AND NOT a.attisdropped)
ORDER BY 1, 2

-- name: adopted_table
-- The schema and name of the table %(source)s (as adopt is given it: search_path applies).
SELECT n.nspname::text AS schema, c.relname::text AS name
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%(source)s)

-- name: adopted_claim_indexes
-- The claim's indexes of the adopted table %(schema)s.%(name)s (relay/adopt_index.py): those
-- adopt or migrate made (named <table>_relay_pending...), of the pending rows in relay_xid
-- order, whatever their third column; valid is false for a concurrent build that did not
-- finish.  The retrying and published rows' indexes begin with other columns.  By the
-- catalog's names, not to_regclass: the relay's role reads it at start (claim_index_not_built)
-- and needs no right on the table's schema when its view is in another.
SELECT c.relname::text AS name, x.indisvalid AS valid
FROM pg_index AS x
JOIN pg_class AS c ON c.oid = x.indexrelid
JOIN pg_attribute AS a ON a.attrelid = x.indrelid AND a.attnum = x.indkey[0]
JOIN pg_class AS t ON t.oid = x.indrelid
JOIN pg_namespace AS n ON n.oid = t.relnamespace
WHERE n.nspname = %(schema)s AND t.relname = %(name)s
  AND a.attname = 'relay_xid'
  AND pg_get_expr(x.indpred, x.indrelid) = '(relay_published_at IS NULL)'
  AND c.relname LIKE '%%\_relay\_pending%%'
ORDER BY 1

-- name: retrying_index
CREATE INDEX CONCURRENTLY IF NOT EXISTS {retrying_index} ON {source} ((aggregateid::text), relay_xid, relay_seq)
    WHERE relay_published_at IS NULL AND relay_retry_at IS NOT NULL

-- name: published_index
CREATE INDEX CONCURRENTLY IF NOT EXISTS {published_index} ON {source} (relay_published_at)
    WHERE relay_published_at IS NOT NULL

-- name: view
CREATE OR REPLACE VIEW {view} AS
SELECT relay_seq            AS id,
       id::text::uuid       AS event_id,
       {topic}              AS topic,
       aggregateid::text    AS key,
       {payload}            AS payload,
       {payload_bytes}      AS payload_bytes,
       jsonb_strip_nulls(jsonb_build_object(
           'id', id::text,
           'eventType', type::text,
           'ce_id', CASE WHEN {ce_source}::text IS NOT NULL THEN id::text END,
           'ce_type', CASE WHEN {ce_source}::text IS NOT NULL THEN type::text END,
           'ce_source', {ce_source}::text,
           'ce_specversion', CASE WHEN {ce_source}::text IS NOT NULL THEN '1.0' END,
           'ce_time', CASE WHEN {ce_source}::text IS NOT NULL
                           THEN to_char(relay_created_at AT TIME ZONE 'UTC',
                                        'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') END
       ))                   AS headers,
       relay_created_at     AS created_at,
       relay_published_at   AS published_at,
       relay_xid            AS xid,
       relay_attempts       AS attempts,
       relay_last_error     AS last_error,
       relay_retry_at       AS retry_at
FROM {source}

-- name: notify_trigger_drop
DROP TRIGGER IF EXISTS outbox_notify_insert ON {source}

-- name: notify_trigger
CREATE TRIGGER outbox_notify_insert
    BEFORE INSERT ON {source}
    FOR EACH STATEMENT
    WHEN (NOT pg_try_advisory_xact_lock_shared(7263740001))
    EXECUTE FUNCTION outbox_notify()

-- name: payload_type
SELECT format_type(a.atttypid, a.atttypmod) AS type
FROM pg_attribute AS a
WHERE a.attrelid = to_regclass(%(source)s) AND a.attname = 'payload' AND NOT a.attisdropped
