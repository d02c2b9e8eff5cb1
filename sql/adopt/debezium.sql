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

-- name: add_columns
ALTER TABLE {source}
    ADD COLUMN IF NOT EXISTS relay_seq bigint GENERATED ALWAYS AS IDENTITY,
    ADD COLUMN IF NOT EXISTS relay_xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    ADD COLUMN IF NOT EXISTS relay_created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS relay_published_at timestamptz,
    ADD COLUMN IF NOT EXISTS relay_attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS relay_last_error text,
    ADD COLUMN IF NOT EXISTS relay_retry_at timestamptz

-- name: pending_index
CREATE INDEX IF NOT EXISTS {pending_index} ON {source} (relay_xid, relay_seq)
    WHERE relay_published_at IS NULL

-- name: retrying_index
CREATE INDEX IF NOT EXISTS {retrying_index} ON {source} ((aggregateid::text), relay_xid, relay_seq)
    WHERE relay_published_at IS NULL AND relay_retry_at IS NOT NULL

-- name: published_index
CREATE INDEX IF NOT EXISTS {published_index} ON {source} (relay_published_at)
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
