-- 0001: the outbox table that services write into, inside their own transactions.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- payload is jsonb: a service can write a JSON document from plain SQL
-- ('{"order": 17}'), PostgreSQL validates it at insert time, and the relay sends
-- its compact text form.  Binary formats (Avro, Protobuf) go into payload_bytes
-- instead; a row carries at most one of them, and neither means a Kafka tombstone.
--
-- xid records the writing transaction (xid8).  The relay only publishes rows whose
-- transaction is older than every transaction still in flight, in (xid, id) order,
-- so a row that commits late can never be overtaken (see README, "Ordering").

CREATE TABLE IF NOT EXISTS outbox (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
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
    CONSTRAINT outbox_event_id_unique UNIQUE (event_id),
    -- Kafka's rules: 1..249 characters of [A-Za-z0-9._-], and not "." or "..".
    CONSTRAINT outbox_topic_valid
        CHECK (topic ~ '^[A-Za-z0-9._-]{1,249}$' AND topic NOT IN ('.', '..')),
    CONSTRAINT outbox_headers_is_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT outbox_one_payload CHECK (payload IS NULL OR payload_bytes IS NULL),
    CONSTRAINT outbox_attempts_nonnegative CHECK (attempts >= 0)
);

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
