-- 0006: one inbox name is one consumer group.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- The inbox key (outbox_inbox.consumer) is the logical consumer's name.  Two Kafka
-- consumer groups sharing one name would each see the other's inbox rows and drop
-- events as "duplicates" that their own group never applied.  A consumer records its
-- group here at its first start; a consumer with the same name and another group is
-- refused at start-up (consumer_sdk InboxGroupConflict).  To move an inbox to a new
-- group on purpose, a DBA updates group_id.

CREATE TABLE IF NOT EXISTS outbox_inbox_consumers (
    consumer    text        NOT NULL,
    group_id    text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_inbox_consumers_pkey PRIMARY KEY (consumer)
);
