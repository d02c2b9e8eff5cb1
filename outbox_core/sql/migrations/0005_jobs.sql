-- 0005: durable runs and jobs of the consumer SDK (consumer_sdk/jobs).
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- A run is what a client asked for (accepted once per (owner_id, request_key),
-- with the SHA-256 of its body, so a reused key with another body is refused).
-- Its job is the unit a worker claims.  The run keeps no status of its own: its
-- status is its job's, so there is one row to fence and nothing to keep in step.
-- Standalone jobs (enqueue without a run) have run_id NULL and carry a payload.
--
-- Leases: a claim sets status 'running', lease_owner, lease_until and
-- lease_token + 1.  Every later write by a worker says WHERE lease_owner = ...
-- AND lease_token = ... AND status = 'running': zero rows means it lost authority.
--
-- Times: every statement of sql/queries/jobs.sql that compares with the clock
-- takes coalesce(%(now)s, now()), so tests control time; defaults here are only
-- for rows written by hand.

CREATE TABLE IF NOT EXISTS runs (
    id           uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    owner_id     text        NOT NULL,
    request_key  text        NOT NULL,
    body_sha256  bytea       NOT NULL,
    kind         text        NOT NULL,
    queue        text        NOT NULL,
    goal         jsonb       NOT NULL,
    traceparent  text,
    tracestate   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT runs_request_key_unique UNIQUE (owner_id, request_key),
    CONSTRAINT runs_body_sha256_length CHECK (octet_length(body_sha256) = 32),
    CONSTRAINT runs_request_key_length CHECK (length(request_key) BETWEEN 1 AND 200),
    CONSTRAINT runs_owner_id_length CHECK (length(owner_id) BETWEEN 1 AND 200)
);

-- fillfactor 80 leaves room on each page for HOT updates: a heartbeat changes no
-- indexed column (lease_until is deliberately not indexed), so renewing a lease
-- writes no index entry and its dead tuple is pruned without a vacuum.
CREATE TABLE IF NOT EXISTS jobs (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id          uuid        REFERENCES runs (id) ON DELETE CASCADE,
    owner_id        text        NOT NULL,
    queue           text        NOT NULL,
    kind            text        NOT NULL,
    payload         jsonb,
    status          text        NOT NULL DEFAULT 'queued',
    available_at    timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    max_attempts    integer     NOT NULL DEFAULT 5,
    lease_owner     text,
    lease_token     bigint      NOT NULL DEFAULT 0,
    lease_until     timestamptz,
    heartbeat_at    timestamptz,
    wait_key        text,
    wait_cause      text,
    wake_at         timestamptz,
    last_error      text,
    last_error_type text,
    result          jsonb,
    traceparent     text,
    tracestate      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    started_at      timestamptz,
    finished_at     timestamptz,
    CONSTRAINT jobs_run_unique UNIQUE (run_id),
    CONSTRAINT jobs_status_valid
        CHECK (status IN ('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled')),
    CONSTRAINT jobs_queue_valid CHECK (queue ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    CONSTRAINT jobs_attempts_valid CHECK (attempts >= 0 AND max_attempts >= 1),
    CONSTRAINT jobs_running_has_lease
        CHECK (status <> 'running' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL)),
    CONSTRAINT jobs_waiting_has_condition
        CHECK (status <> 'waiting' OR wait_key IS NOT NULL OR wake_at IS NOT NULL),
    CONSTRAINT jobs_terminal_has_finish
        CHECK (status NOT IN ('succeeded', 'failed', 'cancelled') OR finished_at IS NOT NULL),
    CONSTRAINT jobs_payload_or_run CHECK (run_id IS NOT NULL OR payload IS NOT NULL)
) WITH (fillfactor = 80);

-- Claimable jobs per queue and owner, in availability order: serves the fair
-- claim (one owner's lane at a time) and the skip-scan that lists ready owners.
CREATE INDEX IF NOT EXISTS jobs_queued_idx
    ON jobs (queue, owner_id, available_at, id) WHERE status = 'queued';

-- Running jobs by owner: the per-owner limit counts them, the reaper scans them
-- for expired leases.  Small: at most the number of jobs running right now.
CREATE INDEX IF NOT EXISTS jobs_running_idx
    ON jobs (owner_id) WHERE status = 'running';

-- Parked jobs: by the activation key they wait for, and by their wake-up time.
CREATE INDEX IF NOT EXISTS jobs_waiting_key_idx
    ON jobs (wait_key) WHERE status = 'waiting';
CREATE INDEX IF NOT EXISTS jobs_waiting_wake_idx
    ON jobs (wake_at) WHERE status = 'waiting' AND wake_at IS NOT NULL;

-- Results written by key: a re-executed job upserts the same keys, so a takeover
-- never duplicates a result.  lease_token says which attempt wrote it last.
CREATE TABLE IF NOT EXISTS job_results (
    job_id      bigint      NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    key         text        NOT NULL,
    value       jsonb,
    lease_token bigint      NOT NULL,
    written_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT job_results_pkey PRIMARY KEY (job_id, key)
);

-- Activations: the durable record that what a parked job waits for has arrived.
-- One row per key (a duplicated activation is the same row), kept even when no
-- job waits yet, so an activation that arrives before the job parks still counts.
CREATE TABLE IF NOT EXISTS job_activations (
    key        text        PRIMARY KEY,
    payload    jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Jobs that ended in 'failed', with a reason a person can read.  One row per job.
CREATE TABLE IF NOT EXISTS job_dead_letters (
    job_id      bigint      PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    run_id      uuid,
    owner_id    text        NOT NULL,
    queue       text        NOT NULL,
    kind        text        NOT NULL,
    reason      text        NOT NULL,
    error       text        NOT NULL,
    error_type  text,
    attempts    integer     NOT NULL,
    traceparent text,
    trace_id    text GENERATED ALWAYS AS (nullif(split_part(traceparent, '-', 2), '')) STORED,
    dead_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT job_dead_letters_reason_valid
        CHECK (reason IN ('permanent_error', 'attempts_exhausted', 'lease_expired'))
);
CREATE INDEX IF NOT EXISTS job_dead_letters_dead_at_idx ON job_dead_letters (dead_at);

-- Wake workers.  Inserts: one statement-level trigger sends the queue names of
-- the new rows (PostgreSQL folds identical notifications of one transaction, so a
-- bulk enqueue costs one NOTIFY per queue).  Updates: only a row that becomes
-- 'queued' again (resumed, retried, lease expired) notifies; the WHEN clause is
-- evaluated without calling the function, so claims and heartbeats pay nothing.
-- Notifications only speed discovery: workers still poll.
CREATE OR REPLACE FUNCTION jobs_notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_jobs', q.queue)
    FROM (SELECT DISTINCT queue FROM inserted) AS q;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION jobs_notify_requeued() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_jobs', NEW.queue);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS jobs_notify_insert ON jobs;
CREATE TRIGGER jobs_notify_insert
    AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION jobs_notify_inserted();

DROP TRIGGER IF EXISTS jobs_notify_requeue ON jobs;
CREATE TRIGGER jobs_notify_requeue
    AFTER UPDATE OF status ON jobs
    FOR EACH ROW
    WHEN (NEW.status = 'queued' AND OLD.status IS DISTINCT FROM 'queued')
    EXECUTE FUNCTION jobs_notify_requeued();
