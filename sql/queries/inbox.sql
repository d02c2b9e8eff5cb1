-- Named queries of the consumer SDK's inbox (consumer_sdk/store.py).  Each block
-- starts with "-- name: <name>"; parameters are psycopg named placeholders.
-- %(now)s is NULL in production (the database clock decides) and a fixed
-- timestamp in tests that control time.

-- name: claim
-- Records that this consumer applies this event, in the caller's transaction.
-- Returns one row when the event is new, none when it was already applied (by
-- this process, another member of the group, or a crashed predecessor); under
-- READ COMMITTED a concurrent insert of the same key makes this statement wait
-- for that transaction, then do nothing if it committed.
INSERT INTO outbox_inbox
    (consumer, event_id, payload_sha256, topic, kafka_partition, kafka_offset, received_at)
VALUES
    (%(consumer)s, %(event_id)s, %(payload_sha256)s, %(topic)s, %(partition)s, %(offset)s,
     coalesce(%(now)s::timestamptz, now()))
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING true AS inserted

-- name: lookup
-- The body hash recorded when the event was applied (a separate statement, so that
-- under READ COMMITTED it sees a row that a concurrent transaction just committed).
SELECT payload_sha256
FROM outbox_inbox
WHERE consumer = %(consumer)s AND event_id = %(event_id)s

-- name: cleanup_batch
-- One bounded batch of rows older than the retention window, for one consumer.
-- SKIP LOCKED: never waits for (or blocks) a consumer's transaction.
DELETE FROM outbox_inbox
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM outbox_inbox
    WHERE consumer = %(consumer)s
      AND received_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(retention_s)s)
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))

-- name: schema_check
SELECT to_regclass('outbox_inbox') IS NOT NULL AS has_inbox

-- name: bind_group
-- Records the consumer group of this inbox name at its first start (no-op afterwards).
INSERT INTO outbox_inbox_consumers (consumer, group_id)
VALUES (%(consumer)s, %(group)s)
ON CONFLICT (consumer) DO NOTHING

-- name: bound_group
-- The group this inbox name belongs to (a separate statement: it sees a concurrent first
-- start's row once that committed).
SELECT group_id FROM outbox_inbox_consumers WHERE consumer = %(consumer)s
