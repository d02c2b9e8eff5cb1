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

-- name: claim_prepare
-- claim as a prepared statement of the connection (created on first use, again after
-- DISCARD ALL or a reconnect).  PgInboxStore executes it by its name (store.CLAIM_STATEMENT:
-- keep the two the same) after the deferred COMMIT and BEGIN, in one libpq pipeline
-- (consumer_sdk/_wire.py): one round trip and the least client CPU.  Parameters:
-- consumer, event id, body hash, topic, partition, offset, now (NULL: the database's clock).
PREPARE outbox_inbox_claim_v1 (text, uuid, bytea, text, integer, bigint, timestamptz) AS
INSERT INTO outbox_inbox
    (consumer, event_id, payload_sha256, topic, kafka_partition, kafka_offset, received_at)
VALUES ($1, $2, $3, $4, $5, $6, coalesce($7, now()))
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING true AS inserted

-- name: claim_strict
-- The claim of a one-trip transaction (PgInboxStore.claim_and_apply): the same row as
-- claim, with no ON CONFLICT, so that an event already applied fails this statement
-- (unique_violation) and the server skips the handler's statements and the COMMIT sent
-- after it in the same pipeline: nothing is written, and the message goes the usual way.
INSERT INTO outbox_inbox
    (consumer, event_id, payload_sha256, topic, kafka_partition, kafka_offset, received_at)
VALUES
    (%(consumer)s, %(event_id)s, %(payload_sha256)s, %(topic)s, %(partition)s, %(offset)s,
     coalesce(%(now)s::timestamptz, now()))

-- name: claim_strict_prepare
-- claim_strict as a prepared statement of the connection (store.CLAIM_STRICT_STATEMENT:
-- keep the two the same), its parameters those of claim_prepare.
PREPARE outbox_inbox_claim_strict_v1 (text, uuid, bytea, text, integer, bigint, timestamptz) AS
INSERT INTO outbox_inbox
    (consumer, event_id, payload_sha256, topic, kafka_partition, kafka_offset, received_at)
VALUES ($1, $2, $3, $4, $5, $6, coalesce($7, now()))

-- name: chain
-- The first statement of a chained transaction (PgInboxStore.send_trip).  One message at
-- a time, a statements handler's transactions go to the server one after another, each
-- sent before the answer to the one before it came back; each must commit only if the one
-- before it did.  Each sets the session setting outbox_inbox.chain to its own mark ($2),
-- which the server takes back when the transaction does not commit; this statement fails
-- unless the setting holds the mark of the transaction sent just before ($1; NULL: the
-- first of a chain, nothing to check).  So a transaction that failed, even at its COMMIT
-- (a deferred constraint), fails every one sent after it, and they are applied again, in
-- order.  The error is a cast that cannot succeed, in the arm taken only then: its text
-- says what happened in the server's log.
SELECT CASE
    WHEN $1::text IS NULL OR current_setting('outbox_inbox.chain', true) = $1::text
    THEN set_config('outbox_inbox.chain', $2::text, false)
    ELSE ('outbox_inbox: the transaction sent before this one did not commit; the chain is at '
          || coalesce(current_setting('outbox_inbox.chain', true), 'nothing'))::integer::text
END

-- name: claim_batch
-- (The arrays go in binary format: a fifth of the client CPU of text arrays.)
-- The claim of a whole batch in one statement (event ids unique within it): inserts the
-- rows that are new and says, in input order, what each one was: 'new' (inserted now),
-- 'duplicate' (applied before with the same body hash), 'mismatch' (applied before with
-- another body) or 'unseen' (not inserted, yet not visible to this statement's snapshot:
-- a concurrent transaction committed it while this one waited, or retention deleted it;
-- the caller asks lookup_batch, whose new snapshot sees a committed row).  The outer
-- SELECT reads outbox_inbox with the statement's snapshot, so it never sees the rows the
-- CTE inserted, only those applied before.
WITH input AS (
    SELECT i.event_id, i.payload_sha256, i.topic, i.kafka_partition, i.kafka_offset, i.ord
    FROM unnest(%(event_ids)b::uuid[], %(hashes)b::bytea[], %(topics)b::text[],
                %(partitions)b::int[], %(offsets)b::bigint[])
         WITH ORDINALITY AS i(event_id, payload_sha256, topic, kafka_partition, kafka_offset, ord)
), inserted AS (
    INSERT INTO outbox_inbox
        (consumer, event_id, payload_sha256, topic, kafka_partition, kafka_offset, received_at)
    SELECT %(consumer)s, input.event_id, input.payload_sha256, input.topic, input.kafka_partition,
           input.kafka_offset, coalesce(%(now)s::timestamptz, now())
    FROM input
    ORDER BY input.ord
    ON CONFLICT (consumer, event_id) DO NOTHING
    RETURNING event_id
)
SELECT CASE WHEN ins.event_id IS NOT NULL THEN 'new'
            WHEN o.event_id IS NULL THEN 'unseen'
            WHEN o.payload_sha256 IS NOT DISTINCT FROM input.payload_sha256 THEN 'duplicate'
            ELSE 'mismatch' END AS claim
FROM input
LEFT JOIN inserted AS ins ON ins.event_id = input.event_id
LEFT JOIN outbox_inbox AS o ON o.consumer = %(consumer)s AND o.event_id = input.event_id
ORDER BY input.ord

-- name: lookup_batch
-- The body hashes recorded for these events (claim_batch's 'unseen' ones), in a new
-- statement whose snapshot sees rows committed meanwhile.
SELECT event_id, payload_sha256
FROM outbox_inbox
WHERE consumer = %(consumer)s AND event_id = ANY(%(event_ids)b::uuid[])

-- name: unclaim
-- Deletes rows the caller's transaction claimed (claim_batch) for records it then did not
-- apply (a handler failed before them): they are claimed again when they are applied.
DELETE FROM outbox_inbox
WHERE consumer = %(consumer)s AND event_id = ANY(%(event_ids)b::uuid[])

-- name: begin
-- PgInboxStore.transaction() sends BEGIN and COMMIT itself (BEGIN rides in a pipeline with
-- the transaction's first statement).
BEGIN

-- name: commit
COMMIT

-- name: savepoint
-- A handler's isolation inside the batch's transaction (PgInboxStore.attempt).
SAVEPOINT outbox_inbox_attempt

-- name: savepoint_next
-- The next handler's savepoint, releasing the previous one, in one round trip.
RELEASE SAVEPOINT outbox_inbox_attempt; SAVEPOINT outbox_inbox_attempt

-- name: savepoint_rollback
ROLLBACK TO SAVEPOINT outbox_inbox_attempt; RELEASE SAVEPOINT outbox_inbox_attempt

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
