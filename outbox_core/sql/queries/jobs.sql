-- Named queries of the consumer SDK's runs and jobs (consumer_sdk/jobs).  Each
-- block starts with "-- name: <name>"; parameters are psycopg named placeholders.
--
-- Time: every comparison with the clock uses coalesce(%(now)s::timestamptz, now()).
-- %(now)s is NULL in production (the database clock is the one reference for
-- leases) and a fixed timestamp in tests that control time.
--
-- Fencing: a worker's writes say WHERE lease_owner = %(worker)s AND lease_token =
-- %(token)s AND status = 'running' AND lease_until > now; zero rows means the
-- worker lost its authority and must write nothing more.  A writer that must
-- not overtake a handler's fenced transaction (see fenced_lock) first selects
-- the row FOR UPDATE: the claim path (reap_expired) with SKIP LOCKED, cancel_run
-- waiting.

-- ---- accepting runs -------------------------------------------------------------

-- name: accept_probe
-- The run this owner already accepted under this request key (if any), and the
-- queue's pending jobs (queued or running) counted up to %(count_cap)s only:
-- admission control needs to know whether the backlog passed a bound, not its
-- exact size.  count_cap 0 skips the count.
SELECT e.run_id, e.body_sha256, e.job_id, e.status,
       (SELECT count(*) FROM (
            SELECT 1 FROM jobs AS j
            WHERE j.queue = %(queue)s AND j.status IN ('queued', 'running')
            LIMIT %(count_cap)s) AS p) AS pending
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT r.id AS run_id, r.body_sha256, j.id AS job_id, j.status
    FROM runs AS r JOIN jobs AS j ON j.run_id = r.id
    WHERE r.owner_id = %(owner_id)s AND r.request_key = %(request_key)s
) AS e ON true

-- name: insert_run
-- The run and its first job in one statement.  ON CONFLICT DO NOTHING: when a
-- concurrent accept of the same key committed first, this returns no row (after
-- waiting for that transaction) and the caller reads the winner's run.
WITH run AS (
    INSERT INTO runs (owner_id, request_key, body_sha256, kind, queue, goal,
                      traceparent, tracestate, created_at)
    VALUES (%(owner_id)s, %(request_key)s, %(body_sha256)s, %(kind)s, %(queue)s,
            %(goal)s::jsonb, %(traceparent)s, %(tracestate)s,
            coalesce(%(now)s::timestamptz, now()))
    ON CONFLICT (owner_id, request_key) DO NOTHING
    RETURNING id, owner_id, kind, queue, traceparent, tracestate, created_at
)
INSERT INTO jobs (run_id, owner_id, queue, kind, max_attempts, traceparent, tracestate,
                  available_at, created_at)
SELECT id, owner_id, queue, kind, %(max_attempts)s, traceparent, tracestate,
       created_at, created_at
FROM run
RETURNING run_id, id AS job_id

-- name: run_status
-- A run as its owner sees it; the run's status is its job's.  owner_id NULL
-- reads any owner's run (operators).
SELECT r.id AS run_id, r.owner_id, r.request_key, r.kind, r.queue, r.goal::text AS goal_text,
       r.traceparent, r.created_at, j.id AS job_id, j.status, j.attempts, j.max_attempts,
       j.result::text AS result_text, j.last_error, j.last_error_type, j.wait_cause,
       j.wait_key, j.available_at, j.finished_at, d.reason AS dead_reason,
       extract(epoch FROM j.available_at - coalesce(%(now)s::timestamptz, now()))::float8
           AS available_in_s
FROM runs AS r
JOIN jobs AS j ON j.run_id = r.id
LEFT JOIN job_dead_letters AS d ON d.job_id = j.id
WHERE r.id = %(run_id)s AND (%(owner_id)s::text IS NULL OR r.owner_id = %(owner_id)s)

-- name: cancel_run
-- The owner's cancellation: a job not yet terminal becomes 'cancelled'.  A worker
-- running it finds out at its next heartbeat or write (status is no longer
-- 'running') and stops without writing.  FOR UPDATE waits for a handler's open
-- fenced transaction, so a cancellation never lands inside one.
WITH target AS (
    SELECT j.id, j.status AS previous
    FROM jobs AS j JOIN runs AS r ON r.id = j.run_id
    WHERE r.id = %(run_id)s AND r.owner_id = %(owner_id)s
    FOR UPDATE OF j
)
UPDATE jobs AS j
SET status = 'cancelled', finished_at = coalesce(%(now)s::timestamptz, now()), lease_until = NULL
FROM target
WHERE j.id = target.id AND target.previous IN ('queued', 'running', 'waiting')
RETURNING j.id, target.previous, j.queue, j.kind, j.run_id, j.attempts, j.traceparent,
          j.tracestate, extract(epoch FROM j.finished_at - j.created_at)::float8 AS age_s

-- ---- enqueueing -----------------------------------------------------------------

-- name: enqueue
-- Standalone jobs (no run), any number in one statement, ids in list order.
INSERT INTO jobs (owner_id, queue, kind, payload, max_attempts, available_at,
                  traceparent, tracestate, created_at)
SELECT e.owner_id, e.queue, e.kind, e.payload::jsonb, e.max_attempts,
       coalesce(%(now)s::timestamptz, now()) + make_interval(secs => e.delay_s),
       e.traceparent, e.tracestate, coalesce(%(now)s::timestamptz, now())
FROM unnest(%(owners)s::text[], %(queues)s::text[], %(kinds)s::text[], %(payloads)s::text[],
            %(max_attempts)s::int[], %(delays_s)s::float8[], %(traceparents)s::text[],
            %(tracestates)s::text[])
     WITH ORDINALITY AS e(owner_id, queue, kind, payload, max_attempts, delay_s,
                          traceparent, tracestate, ord)
ORDER BY e.ord
RETURNING id

-- ---- claiming -------------------------------------------------------------------

-- name: ready_lanes
-- The (queue, owner) lanes with work ready now, found by a skip-scan over
-- jobs_queued_idx (one index probe per owner, not one row per job), at most
-- %(max_owners)s owners per queue.  A queue's owners are listed from the first one after
-- its cursor (%(after)s, in %(queues)s's order: the owner the pool served last there;
-- NULL: from the first owner), then from the first owner up to the cursor: with more
-- ready owners than %(max_owners)s, each read starts where the pool's service stopped, so
-- every owner comes in turn (cut in owner_id order instead, the owners after the first
-- %(max_owners)s waited until those had no work left).  Each lane comes with its ready
-- jobs counted up to %(count_cap)s and the owner's jobs running under a live lease (any
-- queue); rows in that order per queue.  Each branch below is gated by conditions on the
-- previous row only (one-time filters) and is a range of the index: the wrapped part
-- ends at the cursor instead of filtering the owners after it.
WITH RECURSIVE lanes(queue, after, owner_id, wrapped, depth) AS (
    SELECT q.queue, q.after, q.after, false, 0
    FROM unnest(%(queues)s::text[], %(after)s::text[]) AS q(queue, after)
    UNION ALL
    SELECT l.queue, l.after, n.owner_id, n.wrapped, l.depth + 1
    FROM lanes AS l
    CROSS JOIN LATERAL (
        (SELECT j.owner_id, false AS wrapped FROM jobs AS j  -- no cursor: from the first owner
         WHERE l.owner_id IS NULL AND j.status = 'queued' AND j.queue = l.queue
           AND j.available_at <= coalesce(%(now)s::timestamptz, now())
         ORDER BY j.owner_id LIMIT 1)
        UNION ALL
        (SELECT j.owner_id, false FROM jobs AS j  -- the next owner, before wrapping
         WHERE NOT l.wrapped AND j.status = 'queued' AND j.queue = l.queue AND j.owner_id > l.owner_id
           AND j.available_at <= coalesce(%(now)s::timestamptz, now())
         ORDER BY j.owner_id LIMIT 1)
        UNION ALL
        (SELECT j.owner_id, true FROM jobs AS j  -- wrapping: the first owner, up to the cursor
         WHERE NOT l.wrapped AND l.after IS NOT NULL AND j.status = 'queued' AND j.queue = l.queue
           AND j.owner_id <= l.after AND j.available_at <= coalesce(%(now)s::timestamptz, now())
         ORDER BY j.owner_id LIMIT 1)
        UNION ALL
        (SELECT j.owner_id, true FROM jobs AS j  -- wrapped: the next owner, up to the cursor
         WHERE l.wrapped AND j.status = 'queued' AND j.queue = l.queue AND j.owner_id > l.owner_id
           AND j.owner_id <= l.after AND j.available_at <= coalesce(%(now)s::timestamptz, now())
         ORDER BY j.owner_id LIMIT 1)
        LIMIT 1
    ) AS n
    WHERE l.depth < %(max_owners)s
)
SELECT l.queue, l.owner_id,
       (SELECT count(*) FROM (
            SELECT 1 FROM jobs AS j
            WHERE j.status = 'queued' AND j.queue = l.queue AND j.owner_id = l.owner_id
              AND j.available_at <= coalesce(%(now)s::timestamptz, now())
            LIMIT %(count_cap)s) AS c)::int AS ready,
       (SELECT count(*) FROM jobs AS j
        WHERE j.status = 'running' AND j.owner_id = l.owner_id
          AND j.lease_until > coalesce(%(now)s::timestamptz, now()))::int AS running
FROM lanes AS l
WHERE l.depth > 0
ORDER BY l.depth

-- name: claim_begin
-- jobs.queue.claim() sends BEGIN itself, in one pipeline with lock_owners.
BEGIN

-- name: claim_commit
-- ... and COMMIT in one pipeline with claim.
COMMIT

-- name: lock_owners
-- Serializes claims per owner across every worker process, so two claimers can
-- never both count the same free room under an owner's limit.  A claimer that
-- does not get an owner's lock skips that owner this round (another claimer is
-- serving it): no claim ever waits.  Transaction-level: released at commit,
-- after the claimed rows are visible, so the next holder counts them.  Only taken
-- when an owner limit can bind (jobs.queue.claim: without one, the claim alone).
SELECT o.owner_id
FROM unnest(%(owners)s::text[]) AS o(owner_id)
-- (1785686643: this SDK's advisory-lock space for owners; 1785686644 for activation keys.)
WHERE pg_try_advisory_xact_lock(1785686643, hashtext(o.owner_id))

-- name: claim
-- Completes the jobs of %(done)s, then claims up to n ready jobs from each (queue,
-- owner) lane in one statement, for owners whose lock_owners lock this transaction
-- holds (taken in an earlier statement, so this statement's snapshot sees every claim
-- committed before).  The per-owner limit counts the owner's jobs running under a live
-- lease; lanes of one owner share its remaining room in list order.  Each claimed job
-- gets status 'running', this worker as lease owner, a lease and lease_token + 1.
--
-- %(takes)s is a JSON array of [queue, owner_id, n, owner_limit]; %(done)s a JSON array
-- of [job id, lease token, result] (successes of this worker, fenced one by one as in
-- complete; '[]' for none): JSON text costs the client far less than five arrays.
-- Rows: 'claimed' (the claim's columns) or 'done' (a completed job; the jobs of
-- %(done)s missing from them lost their lease).  The jobs completed here still count
-- as running for the owner limit (the statement's snapshot): a claim errs on the safe side.
--
-- The round's byte budget (%(budget_bytes)s): the jobs' payloads (or their run's goal) and
-- activation payloads come back in one result, decoded at once: 64 jobs of 200 MB would be
-- 13 GB in the worker process, killed for it, and so each replica that claimed them next.
-- The pool passes what its limit leaves (max_payload_bytes less the payload bytes of the jobs
-- it holds; it claims nothing at all once they reach the limit).  The candidates are taken in
-- the plan's order (queues by priority, then turns: each lane's first job, then each lane's
-- second...) up to the one that crosses the budget, that one included, as in the relay's
-- batches: a round brings at most the budget plus one job.  The first is always taken (the
-- budget is at least 1), so a job over the budget still runs.  A lane cut gets nothing this
-- round, and the pool serves it first in the next (its last turn is the oldest).  A value
-- stored uncompressed counts its stored size (read from its header), a compressed one its
-- text's length (decompressed: measured only for candidates whose stored sizes fit, so a
-- round never decompresses the values it cannot take).  Each claimed row says its size as
-- counted here (payload_bytes): the pool holds it until the job's attempt ends.
WITH done_in AS (
    SELECT (e->>0)::bigint AS id, (e->>1)::bigint AS token, e->2 AS result
    FROM jsonb_array_elements(%(done)s::jsonb) AS e
), done AS (
    UPDATE jobs AS j
    SET status = 'succeeded', result = d.result, lease_until = NULL,
        finished_at = coalesce(%(now)s::timestamptz, now())
    FROM done_in AS d
    -- By primary key (see the UPDATE below).
    WHERE j.id = ANY (ARRAY(SELECT id FROM done_in)) AND j.id = d.id
      AND j.lease_owner = %(worker)s AND j.lease_token = d.token
      AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
    RETURNING j.id, j.run_id, j.queue, j.kind, j.attempts, j.traceparent, j.tracestate,
              extract(epoch FROM j.finished_at - j.created_at)::float8 AS age_s
), want AS (
    SELECT w.ord, w.e->>0 AS queue, w.e->>1 AS owner_id, (w.e->>2)::int AS n,
           (w.e->>3)::int AS owner_limit
    FROM jsonb_array_elements(%(takes)s::jsonb) WITH ORDINALITY AS w(e, ord)
), running AS (
    SELECT j.owner_id, count(*)::int AS n
    FROM jobs AS j
    WHERE j.status = 'running' AND j.owner_id IN (SELECT owner_id FROM want)
      AND j.lease_until > coalesce(%(now)s::timestamptz, now())
    GROUP BY j.owner_id
), room AS (
    SELECT want.ord, min(want.ord) OVER (PARTITION BY want.queue) AS queue_rank,
           want.queue, want.owner_id,
           greatest(0, least(want.n, want.owner_limit - coalesce(r.n, 0)
               - coalesce(sum(want.n) OVER (PARTITION BY want.owner_id ORDER BY want.ord
                          ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)::int)) AS take
    FROM want LEFT JOIN running AS r USING (owner_id)
), picked AS (
    SELECT c.id, room.queue_rank, room.ord,
           row_number() OVER (PARTITION BY room.ord ORDER BY c.available_at, c.id) AS turn,
           coalesce(c.payload, (SELECT r.goal FROM runs AS r WHERE r.id = c.run_id)) AS body,
           (SELECT a.payload FROM job_activations AS a WHERE a.key = c.wait_key) AS activation
    FROM room
    CROSS JOIN LATERAL (
        SELECT j.id, j.available_at, j.payload, j.run_id, j.wait_key FROM jobs AS j
        WHERE j.status = 'queued' AND j.queue = room.queue AND j.owner_id = room.owner_id
          AND j.available_at <= coalesce(%(now)s::timestamptz, now())
        ORDER BY j.available_at, j.id
        LIMIT room.take
        FOR UPDATE SKIP LOCKED
    ) AS c
), stored AS (
    -- The budget by stored sizes first (cheap: no value is read), close to the sizes below
    -- or under them (compressed): a cut here only comes early, never lets more through.
    SELECT p.*, s.bytes, sum(s.bytes) OVER (ORDER BY p.queue_rank, p.turn, p.ord
                                            ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS running
    FROM picked AS p
    CROSS JOIN LATERAL (SELECT coalesce(pg_column_size(p.body), 0)
                               + coalesce(pg_column_size(p.activation), 0) AS bytes) AS s
), sized AS (
    SELECT f.id, s.bytes, sum(s.bytes) OVER (ORDER BY f.queue_rank, f.turn, f.ord
                                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS running
    FROM stored AS f
    CROSS JOIN LATERAL (SELECT
        CASE WHEN pg_column_compression(f.body) IS NULL THEN coalesce(pg_column_size(f.body), 0)
             ELSE octet_length(f.body::text) END
        + CASE WHEN pg_column_compression(f.activation) IS NULL THEN coalesce(pg_column_size(f.activation), 0)
               ELSE octet_length(f.activation::text) END AS bytes) AS s
    WHERE f.running - f.bytes < %(budget_bytes)s::bigint
), kept AS (
    SELECT s.id, s.bytes FROM sized AS s WHERE s.running - s.bytes < %(budget_bytes)s::bigint
), claimed AS (
    UPDATE jobs AS j
    SET status = 'running',
        lease_owner = %(worker)s,
        lease_token = j.lease_token + 1,
        lease_until = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_s)s),
        heartbeat_at = coalesce(%(now)s::timestamptz, now()),
        attempts = j.attempts + 1,
        started_at = coalesce(j.started_at, coalesce(%(now)s::timestamptz, now()))
    -- By primary key: a join with picked (planned for ~30 rows) made the planner hash-join a
    -- sequential scan of the whole table, a claim growing with every finished job kept.
    WHERE j.id = ANY (ARRAY(SELECT kept.id FROM kept))
    RETURNING j.id, j.run_id, j.owner_id, j.queue, j.kind, j.lease_token, j.attempts, j.max_attempts,
              coalesce(j.payload, (SELECT r.goal FROM runs AS r WHERE r.id = j.run_id))::text
                  AS payload_text,
              j.traceparent, j.tracestate, j.wait_key,
              (SELECT a.payload::text FROM job_activations AS a WHERE a.key = j.wait_key)
                  AS activation_text,
              extract(epoch FROM j.created_at)::float8 AS created_epoch
)
SELECT 'claimed' AS what, c.id, c.run_id, c.owner_id, c.queue, c.kind, c.lease_token, c.attempts,
       c.max_attempts, c.payload_text, c.traceparent, c.tracestate, c.wait_key, c.activation_text,
       c.created_epoch, k.bytes::bigint AS payload_bytes
FROM claimed AS c JOIN kept AS k ON k.id = c.id
UNION ALL
SELECT 'done', id, run_id, NULL, queue, kind, NULL, attempts, NULL, NULL, traceparent,
       tracestate, NULL, NULL, age_s, NULL
FROM done

-- name: release_unheld
-- After a claim of this worker whose reply was lost (the connection broke while it
-- waited, perhaps after the commit): the jobs running under this worker that its pool
-- does not hold (%(held)s: the ids of every attempt it holds) were claimed by that
-- statement, and no handler runs them.  Given back as release does (claimable at once,
-- the attempt not counted).  Before, they waited out their lease, and the reaper counted
-- the attempt or, on their last one, failed them with a dead letter: never run.
UPDATE jobs AS j
SET status = 'queued', lease_until = NULL, attempts = greatest(0, j.attempts - 1),
    available_at = coalesce(%(now)s::timestamptz, now())
WHERE j.status = 'running' AND j.lease_owner = %(worker)s
  AND j.lease_until > coalesce(%(now)s::timestamptz, now())
  AND NOT (j.id = ANY (%(held)s::bigint[]))
RETURNING j.id

-- name: reap_expired
-- Running jobs whose lease expired (the worker died, hung or was cut off): back to
-- 'queued' at their old place in line, or, when their attempts are used up, to
-- 'failed' with a dead letter.  The lease token stays, so the next claim makes it
-- grow and the old owner's writes stay fenced.  FOR UPDATE SKIP LOCKED: a row
-- that a handler's fenced transaction holds is still owned, and is left alone.
WITH expired AS (
    SELECT j.id, j.attempts >= j.max_attempts AS exhausted
    FROM jobs AS j
    WHERE j.status = 'running' AND j.lease_until <= coalesce(%(now)s::timestamptz, now())
    ORDER BY j.lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE jobs AS j
    SET status = 'queued', lease_until = NULL,
        last_error = 'lease expired: worker ' || coalesce(j.lease_owner, '?')
                     || ' stopped renewing it (attempt ' || j.attempts || ')',
        last_error_type = 'LeaseExpired'
    FROM expired AS e
    WHERE j.id = e.id AND NOT e.exhausted
    RETURNING j.id, j.queue
), failed AS (
    UPDATE jobs AS j
    SET status = 'failed', lease_until = NULL,
        finished_at = coalesce(%(now)s::timestamptz, now()),
        last_error = 'lease expired on the last attempt (' || j.attempts || ' of '
                     || j.max_attempts || '): worker ' || coalesce(j.lease_owner, '?')
                     || ' stopped renewing it',
        last_error_type = 'LeaseExpired'
    FROM expired AS e
    WHERE j.id = e.id AND e.exhausted
    RETURNING j.id, j.run_id, j.owner_id, j.queue, j.kind, j.attempts, j.last_error,
              j.traceparent, j.tracestate, j.created_at, j.finished_at
), dead AS (
    INSERT INTO job_dead_letters (job_id, run_id, owner_id, queue, kind, reason, error,
                                  error_type, attempts, traceparent, dead_at)
    SELECT id, run_id, owner_id, queue, kind, 'lease_expired', last_error, 'LeaseExpired',
           attempts, traceparent, finished_at
    FROM failed
    ON CONFLICT (job_id) DO UPDATE
    SET reason = excluded.reason, error = excluded.error, error_type = excluded.error_type,
        attempts = excluded.attempts, dead_at = excluded.dead_at
)
SELECT 'requeued' AS outcome, id, queue, NULL::uuid AS run_id, NULL::text AS kind,
       NULL::int AS attempts, NULL::text AS traceparent, NULL::text AS tracestate,
       NULL::float8 AS age_s
FROM requeued
UNION ALL
SELECT 'failed', id, queue, run_id, kind, attempts, traceparent, tracestate,
       extract(epoch FROM finished_at - created_at)::float8
FROM failed

-- ---- a running job's writes (all fenced) ------------------------------------------

-- name: heartbeat
-- Renews the leases this worker holds, by token, in one statement.  A job whose
-- "held" is false lost its lease (expired, taken over, or finished elsewhere) or
-- was cancelled ("status" tells which, as read before this statement): its
-- handler must stop.  Changes no indexed column: a HOT update.
WITH renewed AS (
    UPDATE jobs AS j
    SET lease_until = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_s)s),
        heartbeat_at = coalesce(%(now)s::timestamptz, now())
    FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS h(id, token)
    WHERE j.id = h.id AND j.lease_token = h.token AND j.lease_owner = %(worker)s
      AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
    RETURNING j.id
)
SELECT h.id, r.id IS NOT NULL AS held, j.status
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS h(id, token)
LEFT JOIN renewed AS r ON r.id = h.id
LEFT JOIN jobs AS j ON j.id = h.id
-- A job this very lease completed (its completion committed while the heartbeat was on
-- its way) lost nothing: it is left out, neither renewed nor lost.
WHERE NOT (r.id IS NULL AND j.status = 'succeeded' AND j.lease_owner = %(worker)s
           AND j.lease_token = h.token)

-- name: fenced_begin
-- JobContext.fenced_transaction sends BEGIN itself, in one pipeline with the prepared
-- fence (fence_prepare), or with fenced_lock where it cannot stay prepared.
BEGIN

-- name: fence_prepare
-- fenced_lock as a prepared statement of the connection (created on first use, again
-- after DISCARD ALL or a reconnect).  jobs.queue.fence_begin executes it by its name
-- (jobs.queue.FENCE_STATEMENT: keep the two the same) with fenced_begin, in one libpq
-- pipeline (consumer_sdk/_wire.py): one round trip, no planning, and less client
-- CPU than psycopg's pipeline or cursor.  Parameters: job id, lease token, now (NULL:
-- the database's clock).  Without the worker: every claim gives a job a new
-- lease_token, so (id, token) names one claim.
PREPARE outbox_jobs_fence_v2 (bigint, bigint, timestamptz) AS
SELECT 1 AS held
FROM jobs
WHERE id = $1 AND lease_token = $2
  AND status = 'running' AND lease_until > coalesce($3, now())
FOR KEY SHARE

-- name: fence_raise_prepare
-- outbox_jobs_fence (migration 0012) as a prepared statement of the connection, for
-- JobContext.fenced_execute: BEGIN, this, the handler's statement and COMMIT go in one
-- libpq pipeline (jobs.fenced.fenced_execute; jobs.fenced.RAISING_FENCE_STATEMENT names it:
-- keep the two the same).  When the lease is not held it raises, the pipeline aborts,
-- and the statement and the COMMIT are skipped.  Parameters: job id, lease token, now
-- (NULL: the database's clock).
PREPARE outbox_jobs_fence_v3 (bigint, bigint, timestamptz) AS
SELECT outbox_jobs_fence($1, $2, $3)

-- name: fence_raise_in_pipeline
-- outbox_jobs_fence (migration 0012) as the first statement of a fenced transaction
-- whose handler opened a psycopg pipeline (jobs.deferred): psycopg queues a command
-- there without parameters, so the values are composed in with psycopg.sql.Literal
-- (integers and a timestamp, never text).  When the lease is not held it raises and
-- the pipeline skips what follows up to its Sync.
SELECT outbox_jobs_fence({id}, {token}, {now})

-- name: fenced_lock
-- The first statement of a handler's fenced transaction (JobContext.fenced_transaction).
-- FOR KEY SHARE is the weakest row lock that still conflicts with FOR UPDATE, the
-- lock every takeover path takes first (reap_expired's FOR UPDATE SKIP LOCKED skips
-- the row, cancel_run's FOR UPDATE waits): no one can take the job over or cancel
-- it between this check and the commit, so the handler's writes commit only while
-- it holds the lease.  It does not conflict with the heartbeat's UPDATE (FOR NO KEY
-- UPDATE), so a long handler transaction never blocks its own lease renewal.
SELECT 1 AS held
FROM jobs
WHERE id = %(id)s AND lease_owner = %(worker)s AND lease_token = %(token)s
  AND status = 'running' AND lease_until > coalesce(%(now)s::timestamptz, now())
FOR KEY SHARE

-- name: put_result
-- A result written by key: a re-executed job overwrites its own earlier value
-- instead of adding a row.  Run inside a fenced transaction.
INSERT INTO job_results (job_id, key, value, lease_token, written_at)
VALUES (%(id)s, %(key)s, %(value)s::jsonb, %(token)s, coalesce(%(now)s::timestamptz, now()))
ON CONFLICT (job_id, key) DO UPDATE
SET value = excluded.value, lease_token = excluded.lease_token, written_at = excluded.written_at

-- name: results
SELECT key, value::text AS value_text, lease_token, written_at
FROM job_results WHERE job_id = %(id)s ORDER BY key

-- name: complete
UPDATE jobs AS j
SET status = 'succeeded', result = %(result)s::jsonb, lease_until = NULL,
    finished_at = coalesce(%(now)s::timestamptz, now())
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
RETURNING j.queue, j.kind, j.run_id, j.attempts, j.traceparent, j.tracestate,
          extract(epoch FROM j.finished_at - j.created_at)::float8 AS age_s

-- name: complete_many
-- The successes a worker process collected since its last round, in one statement,
-- each fenced like complete (owner, token, running, unexpired lease); %(done)s is a
-- JSON array of [job id, lease token, result].  A job missing from the rows lost its
-- lease before its completion was written.  (claim does the same when it has takes.)
WITH done_in AS (
    SELECT (e->>0)::bigint AS id, (e->>1)::bigint AS token, e->2 AS result
    FROM jsonb_array_elements(%(done)s::jsonb) AS e
)
UPDATE jobs AS j
SET status = 'succeeded', result = d.result, lease_until = NULL,
    finished_at = coalesce(%(now)s::timestamptz, now())
FROM done_in AS d
-- j.id = ANY: probed through the primary key, never a join planned over the whole table.
WHERE j.id = ANY (ARRAY(SELECT id FROM done_in)) AND j.id = d.id
  AND j.lease_owner = %(worker)s AND j.lease_token = d.token
  AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
RETURNING j.id, j.run_id, j.queue, j.kind, j.attempts, j.traceparent, j.tracestate,
          extract(epoch FROM j.finished_at - j.created_at)::float8 AS age_s

-- name: completed_by_lease
-- Which of these completions (%(done)s: a JSON array of [job id, lease token]) an earlier
-- statement of this lease wrote: the job succeeded with the lease's token.  Asked only
-- after the reply to a statement that carried them was lost (the connection broke while it
-- waited, perhaps after the commit) and complete_many found them no longer running.
WITH asked AS (
    SELECT (e->>0)::bigint AS id, (e->>1)::bigint AS token
    FROM jsonb_array_elements(%(done)s::jsonb) AS e
)
SELECT j.id, j.run_id, j.queue, j.kind, j.attempts, j.traceparent, j.tracestate,
       extract(epoch FROM j.finished_at - j.created_at)::float8 AS age_s
FROM jobs AS j JOIN asked AS a ON a.id = j.id
-- j.id = ANY: probed through the primary key (see complete_many).
WHERE j.id = ANY (ARRAY(SELECT id FROM asked)) AND j.lease_token = a.token
  AND j.status = 'succeeded' AND j.lease_owner = %(worker)s

-- name: retry
-- A failed attempt that will be tried again after %(backoff_s)s seconds.
UPDATE jobs AS j
SET status = 'queued', lease_until = NULL,
    available_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(backoff_s)s),
    last_error = %(error)s, last_error_type = %(error_type)s
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
RETURNING j.queue, j.kind, j.run_id, j.attempts, j.traceparent, j.tracestate,
          extract(epoch FROM j.available_at)::float8 AS available_epoch

-- name: retried_by_lease
-- Whether an earlier retry of this lease (id, worker, token) committed: asked only after
-- the reply to it was lost and, sent again, it matched no row.  Its state: queued, the
-- lease cleared, the attempt's number unchanged, its error as written.  No other writer
-- leaves that under this token: a claim by anyone gives the job a new token; the reaper's
-- requeue writes a 'lease expired' error of type LeaseExpired (never a handler's
-- "Type: message" with its type), an operator's requeue attempts 0.  Returns when the
-- job is due (epoch seconds).
SELECT extract(epoch FROM j.available_at)::float8 AS available_epoch
FROM jobs AS j
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status = 'queued' AND j.lease_until IS NULL AND j.attempts = %(attempts)s
  AND j.last_error = %(error)s AND j.last_error_type IS NOT DISTINCT FROM %(error_type)s

-- name: fail
-- Terminal failure and its dead letter in one statement: never one without the other.
WITH failed AS (
    UPDATE jobs AS j
    SET status = 'failed', lease_until = NULL,
        finished_at = coalesce(%(now)s::timestamptz, now()),
        last_error = %(error)s, last_error_type = %(error_type)s
    WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
      AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
    RETURNING j.*
), dead AS (
    INSERT INTO job_dead_letters (job_id, run_id, owner_id, queue, kind, reason, error,
                                  error_type, attempts, traceparent, dead_at)
    SELECT id, run_id, owner_id, queue, kind, %(reason)s, %(error)s, %(error_type)s,
           attempts, traceparent, finished_at
    FROM failed
    ON CONFLICT (job_id) DO UPDATE
    SET reason = excluded.reason, error = excluded.error, error_type = excluded.error_type,
        attempts = excluded.attempts, dead_at = excluded.dead_at
)
SELECT queue, kind, run_id, attempts, traceparent, tracestate,
       extract(epoch FROM finished_at - created_at)::float8 AS age_s
FROM failed

-- name: failed_by_lease
-- Whether an earlier fail of this lease (id, worker, token) committed (asked as
-- retried_by_lease is): failed with this attempt's number and error, and its dead letter
-- with this reason and error.  The reaper's dead letter says 'lease_expired', a reason the
-- worker never writes; a claim by anyone gives the job a new token.  fail's columns.
SELECT j.queue, j.kind, j.run_id, j.attempts, j.traceparent, j.tracestate,
       extract(epoch FROM j.finished_at - j.created_at)::float8 AS age_s
FROM jobs AS j JOIN job_dead_letters AS d ON d.job_id = j.id
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status = 'failed' AND j.lease_until IS NULL AND j.attempts = %(attempts)s
  AND j.last_error = %(error)s AND j.last_error_type IS NOT DISTINCT FROM %(error_type)s
  AND d.reason = %(reason)s AND d.error = %(error)s AND d.attempts = j.attempts

-- name: release
-- Gives a running job back (its worker is stopping): claimable at once, and the
-- attempt does not count against max_attempts.  Fenced.
UPDATE jobs AS j
SET status = 'queued', lease_until = NULL, attempts = greatest(0, j.attempts - 1),
    available_at = coalesce(%(now)s::timestamptz, now())
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
RETURNING j.id

-- name: released_by_lease
-- Whether an earlier release of this lease (id, worker, token) committed (asked as
-- retried_by_lease is): queued, the lease cleared, the attempt given back (%(attempts)s,
-- the claim's count, less one).  The reaper's requeue keeps the attempt counted; a claim
-- by anyone gives the job a new token; an operator's requeue of the reaper's dead letter
-- (attempts 0) comes after the lease ran out in the database, after the local deadline at
-- which the resend stops (see parked_by_lease).
SELECT j.id
FROM jobs AS j
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status = 'queued' AND j.lease_until IS NULL AND j.attempts = greatest(0, %(attempts)s - 1)

-- name: give_back_interrupted
-- A running job whose handler failed through no fault of its own (see migrations 0017 and
-- 0018): %(cause)s 'connection_broke' (the database connection broke under it), 'conflict'
-- (SQLSTATE class 40) or 'read_only' (25006).  Given back as release does (the attempt not
-- counted), its error kept, and the interruption counted (the conflicts and the read-only
-- ones also apart), unless the job's interruptions already reached %(max_interruptions)s:
-- then nothing changes and the worker counts the attempt as any failure's.  Due again after
-- %(delay_s)s, times %(growth)s for each read-only interruption the job already had (the
-- retry back-off of a database still read-only), at most %(max_delay_s)s.  One row while this
-- lease holds the job (none: it lost it): the job's interruptions, whether it was given back,
-- its conflicts and read-only ones, and in how many seconds it is due (NULL: not given back).
WITH target AS (
    SELECT j.id, j.interruptions, j.conflict_interruptions, j.read_only_interruptions
    FROM jobs AS j
    WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
      AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
    FOR UPDATE
), given AS (
    UPDATE jobs AS j
    SET status = 'queued', lease_until = NULL, attempts = greatest(0, j.attempts - 1),
        interruptions = t.interruptions + 1,
        conflict_interruptions = t.conflict_interruptions + (%(cause)s::text = 'conflict')::int,
        read_only_interruptions = t.read_only_interruptions + (%(cause)s::text = 'read_only')::int,
        available_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => least(
            %(max_delay_s)s::float8, %(delay_s)s::float8 * power(%(growth)s::float8, CASE
                WHEN %(cause)s::text = 'read_only' THEN least(t.read_only_interruptions, 60) ELSE 0 END))),
        last_error = %(error)s, last_error_type = %(error_type)s
    FROM target AS t
    WHERE j.id = t.id AND t.interruptions < %(max_interruptions)s
    RETURNING j.interruptions, j.conflict_interruptions, j.read_only_interruptions,
              extract(epoch FROM j.available_at - coalesce(%(now)s::timestamptz, now()))::float8 AS due_in_s
)
SELECT coalesce(g.interruptions, t.interruptions) AS interruptions, g.interruptions IS NOT NULL AS given_back,
       coalesce(g.conflict_interruptions, t.conflict_interruptions) AS conflicts,
       coalesce(g.read_only_interruptions, t.read_only_interruptions) AS read_only, g.due_in_s
FROM target AS t LEFT JOIN given AS g ON true

-- name: given_back_by_lease
-- Whether an earlier give_back_interrupted of this lease (id, worker, token) gave the job
-- back (asked as retried_by_lease is): queued, the lease cleared, the attempt given back
-- (%(attempts)s, the claim's count, less one), its error as written.  release writes no
-- error; the reaper's requeue keeps the attempt counted; a claim by anyone gives the job a
-- new token.  give_back_interrupted's row.
SELECT j.interruptions, true AS given_back, j.conflict_interruptions AS conflicts,
       j.read_only_interruptions AS read_only,
       greatest(0, extract(epoch FROM j.available_at - coalesce(%(now)s::timestamptz, now())))::float8 AS due_in_s
FROM jobs AS j
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status = 'queued' AND j.lease_until IS NULL AND j.attempts = greatest(0, %(attempts)s - 1)
  AND j.last_error = %(error)s AND j.last_error_type IS NOT DISTINCT FROM %(error_type)s

-- ---- waiting and activations ------------------------------------------------------

-- name: activation_lock
-- Taken (in its own statement, before park or activate) by both sides of an
-- activation key, so that a park and an activation of the same key never pass
-- each other unseen: whichever comes second sees the first one's commit.
SELECT pg_advisory_xact_lock(1785686644, hashtext(%(key)s))

-- name: park
-- Parks a running job until the activation %(key)s is recorded or %(timeout_s)s
-- pass (either may be NULL, not both).  When the activation is already recorded
-- (it arrived before the job parked), the job goes straight back to 'queued'.
-- attempts restarts at 0: every activation has its own retry budget.  Fenced.
WITH arrived AS (
    SELECT EXISTS (SELECT 1 FROM job_activations WHERE key = %(key)s) AS yes
)
UPDATE jobs AS j
SET status = CASE WHEN arrived.yes THEN 'queued' ELSE 'waiting' END,
    wait_key = %(key)s, wait_cause = %(cause)s, lease_until = NULL, attempts = 0,
    wake_at = CASE WHEN arrived.yes OR %(timeout_s)s::float8 IS NULL THEN NULL
              ELSE coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(timeout_s)s::float8)
              END,
    available_at = coalesce(%(now)s::timestamptz, now())
FROM arrived
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status = 'running' AND j.lease_until > coalesce(%(now)s::timestamptz, now())
RETURNING j.status, j.queue

-- name: parked_by_lease
-- Whether an earlier park of this lease (id, worker, token) committed (asked as
-- retried_by_lease is): its key and cause, attempts 0, waiting, or queued when the key
-- was activated (at the park or since).  A claim by anyone counts an attempt and gives
-- the job a new token; the only other way to attempts 0 under this token is the reaper's
-- dead letter of this lease then an operator's requeue, and the reaper waits until the
-- lease ran out in the database, after the local deadline at which the resend stops.
-- Returns the status, as park does.
SELECT j.status, j.queue
FROM jobs AS j
WHERE j.id = %(id)s AND j.lease_owner = %(worker)s AND j.lease_token = %(token)s
  AND j.status IN ('waiting', 'queued') AND j.lease_until IS NULL AND j.attempts = 0
  AND j.wait_key IS NOT DISTINCT FROM %(key)s AND j.wait_cause IS NOT DISTINCT FROM %(cause)s

-- name: activate
-- Records an activation once per key and resumes the jobs parked on it.  A
-- duplicate finds the key recorded and nothing waiting on it: no second advance.
-- One row per resumed job (one row with a NULL id when none was waiting).
WITH recorded AS (
    INSERT INTO job_activations (key, payload, created_at)
    VALUES (%(key)s, %(payload)s::jsonb, coalesce(%(now)s::timestamptz, now()))
    ON CONFLICT (key) DO NOTHING
    RETURNING key
), resumed AS (
    UPDATE jobs AS j
    SET status = 'queued', wake_at = NULL, available_at = coalesce(%(now)s::timestamptz, now())
    WHERE j.status = 'waiting' AND j.wait_key = %(key)s
    RETURNING j.id, j.queue, j.run_id, j.kind, j.attempts, j.traceparent, j.tracestate
)
SELECT (SELECT count(*) FROM recorded) > 0 AS recorded,
       r.id, r.queue, r.run_id, r.kind, r.attempts, r.traceparent, r.tracestate
FROM (SELECT 1) AS one
LEFT JOIN resumed AS r ON true
ORDER BY r.id

-- name: resume_job
-- An explicit resume (an API call): only a job still waiting moves, so a
-- duplicated call is a no-op.
UPDATE jobs
SET status = 'queued', wake_at = NULL, available_at = coalesce(%(now)s::timestamptz, now())
WHERE id = %(id)s AND status = 'waiting'
RETURNING id, queue

-- name: resume_ready
-- The reconciler: parked jobs whose activation is recorded although they still
-- wait (the wake-up was lost) or whose wake_at passed.  Conditioned on 'waiting',
-- so it races harmlessly with activate and with itself.
WITH ready AS (
    SELECT j.id
    FROM jobs AS j
    WHERE j.status = 'waiting'
      AND ((j.wake_at IS NOT NULL AND j.wake_at <= coalesce(%(now)s::timestamptz, now()))
           OR EXISTS (SELECT 1 FROM job_activations AS a WHERE a.key = j.wait_key))
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs AS j
SET status = 'queued', available_at = coalesce(%(now)s::timestamptz, now()), wake_at = NULL
FROM ready
WHERE j.id = ready.id
RETURNING j.id, j.queue,
          EXISTS (SELECT 1 FROM job_activations AS a WHERE a.key = j.wait_key) AS activated,
          j.run_id, j.kind, j.attempts, j.traceparent, j.tracestate

-- ---- observing and operating --------------------------------------------------------

-- name: queue_stats
-- The gauges of the given queues (run on a timer, not per job).
SELECT q.queue,
       (SELECT count(*) FROM jobs AS j WHERE j.status = 'queued' AND j.queue = q.queue
          AND j.available_at <= coalesce(%(now)s::timestamptz, now()))::int AS ready,
       coalesce((SELECT extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - min(j.available_at))
                 FROM jobs AS j WHERE j.status = 'queued' AND j.queue = q.queue
                   AND j.available_at <= coalesce(%(now)s::timestamptz, now())), 0)::float8
           AS oldest_age_s,
       (SELECT count(*) FROM jobs AS j WHERE j.status = 'running' AND j.queue = q.queue)::int
           AS running,
       (SELECT count(*) FROM jobs AS j WHERE j.status = 'waiting' AND j.queue = q.queue)::int
           AS waiting
FROM unnest(%(queues)s::text[]) AS q(queue)

-- name: dead_letters
SELECT d.job_id, d.run_id, d.owner_id, d.queue, d.kind, d.reason, d.error, d.error_type,
       d.attempts, d.traceparent, d.trace_id, d.dead_at
FROM job_dead_letters AS d
WHERE (%(queue)s::text IS NULL OR d.queue = %(queue)s)
  AND (%(job_id)s::bigint IS NULL OR d.job_id = %(job_id)s)
ORDER BY d.dead_at DESC, d.job_id DESC
LIMIT %(limit)s

-- name: requeue_dead
-- An operator's retry of a dead-lettered job: the record goes, the job is queued
-- again with a fresh attempt budget (and a fresh budget of interruptions: 0017, 0018).
WITH gone AS (
    DELETE FROM job_dead_letters AS d
    WHERE d.job_id = %(job_id)s
      AND EXISTS (SELECT 1 FROM jobs AS j WHERE j.id = d.job_id AND j.status = 'failed')
    RETURNING d.job_id
)
UPDATE jobs AS j
SET status = 'queued', attempts = 0, interruptions = 0, conflict_interruptions = 0,
    read_only_interruptions = 0, finished_at = NULL,
    available_at = coalesce(%(now)s::timestamptz, now())
FROM gone
WHERE j.id = gone.job_id
RETURNING j.id, j.queue

-- name: session_setup
-- Per worker connection: a worker frozen inside a transaction (SIGSTOP, a debugger)
-- is disconnected after %(idle_ms)s ms, so its row locks cannot block a takeover.
SELECT set_config('idle_in_transaction_session_timeout', %(idle_ms)s::text, false)

-- name: fence_keepalive
-- Sent by the heartbeat thread on a handler's connection while its fenced transaction
-- is open and the lease was just renewed: it resets the idle_in_transaction timer, so a
-- fenced transaction lives as long as the lease is renewed, and a frozen worker's (no
-- heartbeat, no keep-alive) is still ended by the server one lease after its last one.
SELECT 1

-- name: listen
LISTEN outbox_jobs

-- name: schema_check
-- Fails with 42P01 (relation "..." does not exist) when a table is missing, as the
-- pool's other statements do: a worker pool reports the one cause whichever meets it.
-- And with 42703 (column "..." does not exist) when the schema is older than this SDK:
-- the newest migration's columns (0018) are named, so a pool started before `migrate`
-- says so at once, not at the first statement that needs them (a job's first conflict).
SELECT 'jobs'::regclass IS NOT NULL AS has_jobs,
       'job_activations'::regclass IS NOT NULL AS has_activations,
       NOT EXISTS (SELECT j.interruptions, j.conflict_interruptions, j.read_only_interruptions
                   FROM jobs AS j LIMIT 0) AS has_newest

-- name: cleanup_finished
-- Retention, one bounded batch: jobs that ended more than %(older_than_s)s seconds
-- ago, with their runs (a run's deletion cascades to its job, results and dead
-- letter).  Failed jobs stay while they have a dead letter: an operator requeues
-- them or deletes the record first.  Deleting a run forgets its request key, so
-- keep runs longer than any client retries a request.
WITH old AS (
    SELECT j.id, j.run_id
    FROM jobs AS j
    WHERE j.status IN ('succeeded', 'failed', 'cancelled')
      AND j.finished_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(older_than_s)s)
      AND NOT EXISTS (SELECT 1 FROM job_dead_letters AS d WHERE d.job_id = j.id)
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), runs_gone AS (
    DELETE FROM runs AS r USING old WHERE r.id = old.run_id RETURNING r.id
), jobs_gone AS (
    DELETE FROM jobs AS j USING old WHERE j.id = old.id AND old.run_id IS NULL RETURNING j.id
)
SELECT (SELECT count(*) FROM runs_gone)::int + (SELECT count(*) FROM jobs_gone)::int AS deleted

-- name: cleanup_activations
-- Retention, one bounded batch: activations older than %(older_than_s)s seconds
-- that no unfinished job refers to (a job waiting on the key, or resumed by it and
-- not yet run, still needs the record).
DELETE FROM job_activations
WHERE key IN (
    SELECT a.key
    FROM job_activations AS a
    WHERE a.created_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(older_than_s)s)
      AND NOT EXISTS (SELECT 1 FROM jobs AS j
                      WHERE j.wait_key = a.key AND j.status IN ('queued', 'running', 'waiting'))
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)

-- name: active_queues
-- Every queue with queued, running or waiting jobs (the jobs CLI's reconcile, by default):
-- a skip scan of jobs_queued_idx, one probe a queue, then the running and waiting jobs.
WITH RECURSIVE queued(queue) AS (
    (SELECT j.queue FROM jobs AS j WHERE j.status = 'queued' ORDER BY j.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM jobs AS j WHERE j.status = 'queued' AND j.queue > q.queue
            ORDER BY j.queue LIMIT 1)
    FROM queued AS q
    WHERE q.queue IS NOT NULL
)
SELECT queue FROM queued WHERE queue IS NOT NULL
UNION
SELECT j.queue FROM jobs AS j WHERE j.status IN ('running', 'waiting')
ORDER BY 1
