-- Named queries of the SDK benchmark (bench/sdk_bench.py): its effect table and the
-- naive baselines it measures the SDK against.  Not used by the SDK at run time.

-- name: setup
CREATE TABLE IF NOT EXISTS bench_effects (
    event_id uuid   NOT NULL,
    consumer text   NOT NULL,
    n        bigint
);
CREATE TABLE IF NOT EXISTS bench_job_effects (job_id bigint NOT NULL, token bigint NOT NULL)

-- name: effect
-- The handler of every consumer variant: one row per applied message.
INSERT INTO bench_effects (event_id, consumer, n) VALUES (%(event_id)s, %(consumer)s, %(n)s)

-- name: naive_inbox
-- The naive dedup consumer: the batch's inbox rows, the new ones returned.
INSERT INTO outbox_inbox (consumer, event_id, payload_sha256, topic, kafka_partition, kafka_offset)
SELECT %(consumer)s, e.event_id, NULL, e.topic, e.kafka_partition, e.kafka_offset
FROM unnest(%(event_ids)s::uuid[], %(topics)s::text[], %(partitions)s::int[], %(offsets)s::bigint[])
     AS e(event_id, topic, kafka_partition, kafka_offset)
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING event_id

-- name: naive_inbox_one
-- The naive one-at-a-time consumer: one message's inbox row, returned when new.
INSERT INTO outbox_inbox (consumer, event_id, payload_sha256, topic, kafka_partition, kafka_offset)
VALUES (%(consumer)s, %(event_id)s, NULL, %(topic)s, %(partition)s, %(offset)s)
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING event_id

-- name: naive_effects
INSERT INTO bench_effects (event_id, consumer, n)
SELECT e.event_id, %(consumer)s, e.n
FROM unnest(%(event_ids)s::uuid[], %(ns)s::bigint[]) AS e(event_id, n)

-- name: naive_claim
-- The naive worker loop: one job, SKIP LOCKED, running with a new token.
UPDATE jobs AS j
SET status = 'running', lease_owner = %(worker)s, lease_token = j.lease_token + 1,
    lease_until = now() + interval '30 seconds', attempts = j.attempts + 1
WHERE j.id = (SELECT id FROM jobs
              WHERE status = 'queued' AND queue = %(queue)s AND available_at <= now()
              ORDER BY available_at, id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING j.id, j.lease_token

-- name: naive_job_effect
INSERT INTO bench_job_effects (job_id, token) VALUES (%(id)s, %(token)s)

-- name: naive_done
UPDATE jobs SET status = 'succeeded', lease_until = NULL, finished_at = now()
WHERE id = %(id)s AND lease_owner = %(worker)s AND lease_token = %(token)s AND status = 'running'

-- name: job_effect
INSERT INTO bench_job_effects (job_id, token) VALUES (%(id)s, %(token)s)

-- name: rebind
-- Lets an inbox name move to a new consumer group (the redelivery pass reads the topic
-- again under a new group id).
UPDATE outbox_inbox_consumers SET group_id = %(group)s WHERE consumer = %(consumer)s

-- name: counts
SELECT (SELECT count(*) FROM bench_effects WHERE consumer = %(consumer)s)::bigint AS effects

-- name: vacuum_jobs
VACUUM ANALYZE jobs
