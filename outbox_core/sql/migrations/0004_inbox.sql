-- 0004: the consumer SDK's inbox: one row per event a consumer has applied.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- A consumer inserts (consumer, event_id) in the same transaction as the
-- handler's own writes, ON CONFLICT DO NOTHING: the primary key is what makes an
-- effect happen once however often Kafka delivers the event.  "consumer" is the
-- logical consumer's name (by default its Kafka group id), so two services can
-- each apply the same event once.
--
-- payload_sha256 is the SHA-256 of the message value (NULL for a tombstone): the
-- same event_id arriving with another body means a producer reused an id, and
-- the consumer reports it instead of dropping it as a duplicate.
--
-- topic, kafka_partition and kafka_offset say where the applied copy was read;
-- received_at drives retention, which must outlive every possible redelivery.

CREATE TABLE IF NOT EXISTS outbox_inbox (
    consumer        text        NOT NULL,
    event_id        uuid        NOT NULL,
    payload_sha256  bytea,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_inbox_pkey PRIMARY KEY (consumer, event_id),
    CONSTRAINT outbox_inbox_sha256_length
        CHECK (payload_sha256 IS NULL OR octet_length(payload_sha256) = 32),
    CONSTRAINT outbox_inbox_position_nonnegative
        CHECK (kafka_partition >= 0 AND kafka_offset >= 0)
);

-- Serves retention: one consumer's rows by age.
CREATE INDEX IF NOT EXISTS outbox_inbox_received_idx
    ON outbox_inbox (consumer, received_at);
