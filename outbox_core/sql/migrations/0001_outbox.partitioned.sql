-- 0001, partitioned variant: applied instead of 0001_outbox.sql by
-- `outbox-relay migrate --partitioned` on a database without an outbox yet.
--
-- For heavy users: the outbox is partitioned by day on created_at, and
-- `outbox-relay cleanup` (or run's built-in schedule) creates the coming days'
-- partitions and drops a past day's partition whole once every row in it is
-- published and past retention: no row-by-row deletes, no bloat.
--
-- Differences from the plain table, forced by PostgreSQL's rules for partitioned
-- tables: the primary key is (id, created_at) and event_id is unique per
-- partition (event_id, created_at), not globally; event_ids are random UUIDs, and
-- consumers dedupe on them anyway.  Rows whose created_at falls outside every
-- daily partition land in outbox_default (a writer that sets created_at by hand);
-- keep it empty, cleanup reports it.

CREATE TABLE IF NOT EXISTS outbox (
    id            bigint GENERATED ALWAYS AS IDENTITY,
    event_id      uuid        NOT NULL DEFAULT gen_random_uuid(),
    topic         text        NOT NULL,
    key           text,
    payload       jsonb,
    payload_bytes bytea,
    headers       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz,
    xid           xid8        NOT NULL DEFAULT pg_current_xact_id(),
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    retry_at      timestamptz,
    CONSTRAINT outbox_pkey PRIMARY KEY (id, created_at),
    CONSTRAINT outbox_event_id_unique UNIQUE (event_id, created_at),
    CONSTRAINT outbox_topic_valid
        CHECK (topic ~ '^[A-Za-z0-9._-]{1,249}$' AND topic NOT IN ('.', '..')),
    CONSTRAINT outbox_headers_is_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT outbox_one_payload CHECK (payload IS NULL OR payload_bytes IS NULL),
    CONSTRAINT outbox_attempts_nonnegative CHECK (attempts >= 0)
) PARTITION BY RANGE (created_at);

CREATE TABLE IF NOT EXISTS outbox_default PARTITION OF outbox DEFAULT;

-- Serves the relay's claim: pending rows in (xid, id) order.  Partial, so rows
-- already published cost nothing however many stay in the table.
CREATE INDEX IF NOT EXISTS outbox_pending_idx
    ON outbox (xid, id) WHERE published_at IS NULL;

-- Serves "is an earlier row of this key waiting for a retry?" (poison rows block
-- only their own key).  Tiny: only rows in back-off are in it.
CREATE INDEX IF NOT EXISTS outbox_retrying_idx
    ON outbox (key, xid, id) WHERE published_at IS NULL AND retry_at IS NOT NULL;

-- Serves retention: published rows by age.
CREATE INDEX IF NOT EXISTS outbox_published_idx
    ON outbox (published_at) WHERE published_at IS NOT NULL;
