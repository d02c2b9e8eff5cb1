-- Named queries of the web console (relay/console_store.py): reads only; its actions
-- reuse the admin queries (admin.sql, replay.sql) and consumer_sdk.jobs functions.
-- {table} is the outbox, composed with psycopg.sql.Identifier.

-- name: waiting
-- What waits and why: pending rows in back-off, by the class of their last error
-- (the text before the first colon; the message itself may quote a payload).
SELECT split_part(coalesce(last_error, 'unknown'), ':', 1) AS reason, count(*) AS rows,
       min(retry_at) AS next_retry_at, max(attempts) AS max_attempts
FROM {table}
WHERE published_at IS NULL AND retry_at IS NOT NULL
GROUP BY 1
ORDER BY 2 DESC
LIMIT 20

-- name: jobs_by_state
SELECT queue, status, count(*) AS jobs
FROM jobs
GROUP BY queue, status
ORDER BY queue, status

-- name: runs_list
-- Newest runs first, filtered by their job's state, owner and queue (NULL: any).
SELECT r.id::text AS run_id, r.owner_id, r.kind, r.queue, r.created_at, j.id AS job_id,
       j.status, j.attempts, j.max_attempts, j.lease_owner, j.finished_at
FROM runs AS r
JOIN jobs AS j ON j.run_id = r.id
WHERE (%(status)s::text IS NULL OR j.status = %(status)s::text)
  AND (%(owner)s::text IS NULL OR r.owner_id = %(owner)s::text)
  AND (%(queue)s::text IS NULL OR r.queue = %(queue)s::text)
ORDER BY r.created_at DESC, r.id
LIMIT %(limit)s

-- name: run_job
-- The job of a run: its lease, its attempts and where it stands.
SELECT j.id AS job_id, j.status, j.attempts, j.max_attempts, j.lease_owner, j.lease_token,
       j.lease_until, j.heartbeat_at, j.available_at, j.created_at, j.started_at, j.finished_at,
       j.wait_cause, j.wait_key, j.last_error_type, j.last_error
FROM jobs AS j
WHERE j.run_id = %(run_id)s::uuid

-- name: run_steps
-- A run's history: the results its attempts wrote (keys, not values), in order.
SELECT key, lease_token, written_at
FROM job_results
WHERE job_id = %(job_id)s
ORDER BY written_at, key
LIMIT 200
