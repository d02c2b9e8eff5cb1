-- 0013: an identity for this outbox, written into exactly-once mode's position records.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- In exactly-once mode (relay/exactly_once.py) a relay that takes a shard reads the shard's
-- last position record back from Kafka and marks the rows it lists as published.  Two
-- outboxes whose relays share a position topic and a transactional id prefix (both
-- defaults: every outbox table is "outbox") would mark each other's row ids: rows of one
-- marked published that were never sent.  Each record now names the outbox that wrote it,
-- by this id and the table's name, and a relay that finds another outbox's record stops
-- with a ConfigError before it marks anything.
--
-- A random id per database, made once: a copy of the database (a restored backup, a
-- clone for staging) keeps it, as it keeps the rows the records list.  gen_random_uuid()
-- is built in since PostgreSQL 13; the one settings row gets its own value.
ALTER TABLE outbox_relay_settings
    ADD COLUMN IF NOT EXISTS outbox_id uuid NOT NULL DEFAULT gen_random_uuid();
