-- 0012: the jobs' fence as a function that raises when the lease is not held.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- Why: a handler's fenced transaction costs three round trips (BEGIN with the fence's
-- lock, the handler's statement, COMMIT), because the fence's answer must come back
-- before anything is committed.  A fence that raises instead of returning no row can go
-- in one pipeline with the statement and the COMMIT: when the lease is not held, the
-- error aborts the pipeline, so the statement and the COMMIT are skipped and nothing is
-- written.  JobContext.fenced_execute sends BEGIN, this function, one statement and
-- COMMIT in one round trip (consumer_sdk/jobs/fenced.py).
--
-- The same check as jobs.sql's fence: the job row locked FOR KEY SHARE (no takeover or
-- cancellation can slip in before the commit) when it is running under this lease token
-- and its lease has not run out at p_now (NULL: the database's clock).  Every claim gives
-- the job a new token, so (id, token) names one claim.  SECURITY INVOKER: it reads the
-- caller's jobs table with the caller's privileges.
CREATE OR REPLACE FUNCTION outbox_jobs_fence(p_job_id bigint, p_token bigint, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    PERFORM 1
    FROM jobs AS j
    WHERE j.id = p_job_id AND j.lease_token = p_token
      AND j.status = 'running' AND j.lease_until > coalesce(p_now, now())
    FOR KEY SHARE OF j;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'job %: lease token % does not hold it any more', p_job_id, p_token
            USING HINT = 'It was taken over, cancelled or finished elsewhere; this attempt''s write was rolled back.';
    END IF;
END
$fn$;

-- Workers call it: granted explicitly, for databases whose default privileges revoke
-- EXECUTE from PUBLIC (it grants nothing by itself: it runs with the caller's rights).
GRANT EXECUTE ON FUNCTION outbox_jobs_fence(bigint, bigint, timestamptz) TO PUBLIC;
